#!/usr/bin/env python3
"""Draws bench/decode_e2e_offload.cc's JSON report as one PNG: time per output token of local
against offloaded decode (dense: attention on a GPU cache rank; oracle_topk: the selection there,
delta replies), per batch x context point, with the ratio and the exposed wait; a point that did
not fit is labelled so.
Usage: decode_e2e_offload_plot.py --out plot.png report.json"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("report")
    args = parser.parse_args()
    report = json.load(open(args.report))
    points = report.get("points", [])
    policy = report.get("policy", "dense")
    offloaded_label = ("offloaded (attention on the cache GPU)" if policy == "dense"
                       else f"offloaded {policy} (selection on the cache GPU, deltas)")
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, p in enumerate(points):
        local = p.get("local", {}).get("tpot_ms")
        offloaded = p.get("offloaded", {})
        if local is not None:
            ax.bar(i - 0.2, local, 0.4, color="tab:blue", label=f"local {policy}" if i == 0 else None)
        if "tpot_ms" in offloaded:
            ax.bar(i + 0.2, offloaded["tpot_ms"], 0.4, color="tab:orange",
                   label=offloaded_label if i == 0 else None)
            ax.text(i + 0.2, offloaded["tpot_ms"],
                    f"{p['tpot_ratio_offloaded_to_local']:.2f}x\nwait {offloaded['exposed_wait_ms_per_step']:.2f} ms",
                    ha="center", va="bottom", fontsize=8)
        else:
            ax.text(i + 0.2, local or 0, "does not fit", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels([f"{p['batch']}x{p['context'] // 1024}K" for p in points])
    ax.set_ylabel("ms per decode step (TPOT)")
    where = "one GPU for both" if report.get("same_gpu") else \
        f"model GPU {report.get('model_device')}, cache GPU {report.get('cache_device')}"
    name = report["model"]["config"].split("/")[-1]
    ax.set_title(f"{name} (random weights), {report['device']}\n{where}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
