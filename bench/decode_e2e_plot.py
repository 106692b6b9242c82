#!/usr/bin/env python3
"""Draws bench/decode_e2e.cc's JSON reports (one per model) as one PNG: time per output token
measured vs the HBM roofline (bytes of weights + KV read per step / copy bandwidth), per batch x
context point.  Usage: decode_e2e_plot.py --out plot.png report.json [report.json ...]"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("reports", nargs="+")
    args = parser.parse_args()
    reports = [json.load(open(path)) for path in args.reports]
    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 4), squeeze=False)
    for ax, report in zip(axes[0], reports):
        points = report["points"]
        labels = [f"{p['batch']}x{p['context'] // 1024}K" for p in points]
        x = range(len(points))
        ax.bar([i - 0.2 for i in x], [p["tpot_ms"] for p in points], 0.4, label="measured TPOT")
        ax.bar([i + 0.2 for i in x], [p["roofline_ms"] for p in points], 0.4, label="roofline")
        for i, p in zip(x, points):
            ax.text(i - 0.2, p["tpot_ms"], f"{p['ratio_to_roofline']:.2f}x", ha="center", va="bottom")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels)
        ax.set_ylabel("ms per decode step")
        name = report["model"]["config"].split("/")[-1]
        ax.set_title(f"{name} (random weights), {report['device']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
