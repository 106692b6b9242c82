#!/usr/bin/env python3
"""Plots rubato_bench_decode_e2e_capacity's JSON (bench/decode_e2e_capacity.cc): tokens/s and
TPOT of local dense at the largest batch one card holds against placement across the model GPU
and the cache GPU(s) at the largest batch they hold together, one PNG.

    python3 bench/decode_e2e_capacity_plot.py --out bench/results/X.png bench/results/X.json
"""
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
    sides = [(name, report[name]) for name in ("local", "placed") if name in report]
    labels = []
    for name, side in sides:
        label = f"{name}\nbatch {side['batch']}"
        if name == "placed":
            label += f" ({side['local_batch']} + {side['cache_batch']})"
        labels.append(label)
    fig, (tps, tpot) = plt.subplots(1, 2, figsize=(9, 4))
    tps.bar(labels, [side["tokens_per_s"] for _, side in sides], color=["#888", "#2a7"])
    tps.set_ylabel("tokens/s")
    tpot.bar(labels, [side["tpot_ms"] for _, side in sides], color=["#888", "#2a7"])
    tpot.set_ylabel("TPOT, ms")
    ratio = report.get("placed", {}).get("tokens_per_s_ratio_to_local")
    title = (f"Qwen3-8B shapes, {report['context']} tokens, {report['device']} x{report['gpus']}, "
             f"commit {report['commit']}")
    if ratio is not None:
        title += f": placed {ratio:.2f}x local tokens/s"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
