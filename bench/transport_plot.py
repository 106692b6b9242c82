#!/usr/bin/env python3
"""Draws rubato_bench_transport's device packs (bench/transport_device.cc, the JSON's
"device_packs") as one PNG: one-way latency and bandwidth against message size per series
(NCCL stream-ordered / graph / Post, cudaMemcpyPeer, cuda_peer), with the targets (30 us from
4 KB to 1 MB; 0.85x cudaMemcpyPeer from 64 MB).  Usage: transport_plot.py --out plot.png
report.json"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LATENCY = ["memcpy_peer", "nccl_stream", "nccl_graph", "nccl_post", "cuda_peer_stream",
           "cuda_peer_post", "nccl_nonblocking_stream"]
BANDWIDTH = {"memcpy_peer": "memcpy_peer_gbps", "nccl_stream": "nccl_gbps",
             "cuda_peer_stream": "cuda_peer_gbps"}


def series(points, key):
    xs = [p["bytes"] for p in points if key in p]
    return xs, [p[key] for p in points if key in p]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("report")
    args = parser.parse_args()
    report = json.load(open(args.report))
    packs = report["device_packs"]
    points = packs["points"]
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in LATENCY:
        xs, ys = series(points, f"{name}_one_way_us")
        if xs:
            lat.plot(xs, ys, marker="o", label=name)
    lat.hlines(30, 4096, 1 << 20, colors="k", linestyles="dashed", label="target 30 us")
    lat.set_xscale("log", base=2)
    lat.set_yscale("log")
    lat.set_xlabel("bytes")
    lat.set_ylabel("one-way latency, us (ping-pong / 2)")
    lat.legend(fontsize=8)
    for name, key in BANDWIDTH.items():
        xs, ys = series(points, key)
        if xs:
            bw.plot(xs, ys, marker="o", label=name)
    bw.set_xscale("log", base=2)
    bw.set_xlabel("bytes")
    bw.set_ylabel("GB/s")
    bw.legend(fontsize=8)
    skipped = ", ".join(n["name"] for n in packs.get("not_run", []))
    title = f"device packs, {packs.get('device', '?')}, commit {report.get('commit', '?')}"
    fig.suptitle(title + (f" (not run: {skipped})" if skipped else ""))
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
