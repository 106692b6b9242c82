#!/usr/bin/env python3
"""Joins bench/attention_decode.cc's and bench/attention_sdpa.py's JSON (one device call) into
bench/results/decode_attention_*.json and a PNG: per context, ms, GB/s of K+V read, rubato's
speed relative to SDPA (sdpa_ms / rubato_ms: >= 1 means rubato is faster) and to the copy floor.
"""
import argparse
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rubato", required=True)
    parser.add_argument("--sdpa", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--png")
    args = parser.parse_args()
    rubato = json.load(open(args.rubato))
    sdpa = json.load(open(args.sdpa))
    sdpa_by_context = {p["context"]: p for p in sdpa["points"]}
    points = []
    for p in rubato["points"]:
        s = sdpa_by_context.get(p["context"])
        point = {
            "context": p["context"],
            "rubato_ms": p["median_ms"],
            "sdpa_ms": s["median_ms"] if s else None,
            "rubato_kv_read_gb_per_s": p["kv_read_bytes_per_s"] / 1e9,
            "sdpa_kv_read_gb_per_s": s["kv_read_bytes_per_s"] / 1e9 if s else None,
            "speed_vs_sdpa": s["median_ms"] / p["median_ms"] if s else None,
            "copy_floor_ms": p["copy_floor_ms"],
            "rubato_over_floor": p["median_ms"] / p["copy_floor_ms"],
        }
        points.append(point)
        print(f"context {p['context']:7d}: rubato {point['rubato_ms']:.4f} ms "
              f"({point['rubato_kv_read_gb_per_s']:.0f} GB/s), sdpa {point['sdpa_ms']:.4f} ms "
              f"({point['sdpa_kv_read_gb_per_s']:.0f} GB/s), speed vs sdpa {point['speed_vs_sdpa']:.3f}x, "
              f"over copy floor {point['rubato_over_floor']:.3f}x")
    report = {
        "benchmark": "dense decode attention, rubato split-K paged kernel vs torch SDPA (enable_gqa)",
        "device": rubato["device"],
        "commit": args.commit,
        "command": args.command,
        "rubato_command": rubato["command"],
        "torch": sdpa["torch"],
        "copy_bandwidth_gb_per_s_read_plus_write": rubato["copy_bandwidth_bytes_per_s"] / 1e9,
        "shape": rubato["shape"],
        "notes": "rubato reads a paged cache (shuffled 64-token blocks); SDPA reads contiguous "
                 "[batch][kv_heads][context][head_dim] K/V. Median of 50 timed calls after 10 "
                 "warm-up calls, CUDA events, same process per library, same device call.",
        "points": points,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        contexts = [p["context"] for p in points]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(contexts, [p["rubato_kv_read_gb_per_s"] for p in points], "o-", label="rubato (paged)")
        ax.plot(contexts, [p["sdpa_kv_read_gb_per_s"] for p in points], "s--", label="torch SDPA")
        ax.axhline(report["copy_bandwidth_gb_per_s_read_plus_write"], color="gray", ls=":",
                   label="D2D copy (read+write)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens), batch 16, 32 q / 8 kv heads, d 128, bf16")
        ax.set_ylabel("K+V read (GB/s)")
        ax.set_title(f"decode attention on {report['device']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
