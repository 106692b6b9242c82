#!/usr/bin/env python3
"""Joins bench/attention_decode.cc's and bench/attention_sdpa.py's JSON (one device call) into
bench/results/decode_attention_*.json and a PNG: per context, ms, GB/s of K+V read, rubato's
speed relative to SDPA (sdpa_ms / rubato_ms: >= 1 means rubato is faster) and to the copy floor.
"""
import argparse
import json
import statistics


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rubato", action="append", required=True, help="one per round")
    parser.add_argument("--sdpa", action="append", required=True, help="one per round")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--png")
    args = parser.parse_args()
    rounds_rubato = [json.load(open(path)) for path in args.rubato]
    rounds_sdpa = [json.load(open(path)) for path in args.sdpa]
    rubato = rounds_rubato[0]
    sdpa = rounds_sdpa[0]

    def per_context(rounds):
        table = {}
        for r in rounds:
            for p in r["points"]:
                table.setdefault(p["context"], []).append(p)
        return table

    rubato_by_context = per_context(rounds_rubato)
    sdpa_by_context = per_context(rounds_sdpa)
    points = []
    for context, rs in sorted(rubato_by_context.items()):
        ss = sdpa_by_context.get(context, [])
        rubato_ms = statistics.median(p["median_ms"] for p in rs)
        sdpa_ms = statistics.median(p["median_ms"] for p in ss) if ss else None
        kv_bytes = rs[0]["kv_bytes"]
        point = {
            "context": context,
            "rubato_ms": rubato_ms,
            "sdpa_ms": sdpa_ms,
            "rubato_ms_per_round": [p["median_ms"] for p in rs],
            "sdpa_ms_per_round": [p["median_ms"] for p in ss],
            "rubato_kv_read_gb_per_s": kv_bytes / (rubato_ms / 1e3) / 1e9,
            "sdpa_kv_read_gb_per_s": kv_bytes / (sdpa_ms / 1e3) / 1e9 if sdpa_ms else None,
            "speed_vs_sdpa": sdpa_ms / rubato_ms if sdpa_ms else None,
            "copy_floor_ms": statistics.median(p["copy_floor_ms"] for p in rs),
        }
        point["rubato_over_floor"] = rubato_ms / point["copy_floor_ms"]
        points.append(point)
        print(f"context {context:7d}: rubato {rubato_ms:.4f} ms ({point['rubato_kv_read_gb_per_s']:.0f} GB/s), "
              f"sdpa {sdpa_ms:.4f} ms ({point['sdpa_kv_read_gb_per_s']:.0f} GB/s), "
              f"speed vs sdpa {point['speed_vs_sdpa']:.3f}x "
              f"(rounds: {' '.join(f'{s_:.3f}/{r_:.3f}' for s_, r_ in zip(point['sdpa_ms_per_round'], point['rubato_ms_per_round']))} sdpa/rubato ms), "
              f"over copy floor {point['rubato_over_floor']:.3f}x")
    report = {
        "benchmark": "dense decode attention, rubato split-K paged kernel vs torch SDPA (enable_gqa)",
        "device": rubato["device"],
        "commit": args.commit,
        "command": args.command,
        "rubato_command": rubato["command"],
        "torch": sdpa["torch"],
        "copy_bandwidth_gb_per_s_read_plus_write": statistics.median(
            r["copy_bandwidth_bytes_per_s"] for r in rounds_rubato) / 1e9,
        "rounds": len(rounds_rubato),
        "shape": rubato["shape"],
        "notes": "rubato reads a paged cache (shuffled 64-token blocks); SDPA reads contiguous "
                 "[batch][kv_heads][context][head_dim] K/V. Median of 50 timed calls after 10 "
                 "warm-up calls, CUDA events, one process per library and round; rounds alternate rubato "
                 "and SDPA in one device call and each side's median over rounds is reported.",
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
