#!/usr/bin/env python3
"""Draws bench/attention_sparse.cc's JSON report as a PNG: speedup of two-segment sparse decode
attention over the dense kernel per retention, with the ideal 100 / retention beside it.
Usage: sparse_attention_plot.py --out plot.png report.json"""
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
    points = report["points"]
    x = range(len(points))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [p["speedup_over_dense"] for p in points], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [100.0 / p["retention_percent"] for p in points], 0.4,
           label="ideal (100 / retention)", alpha=0.5)
    for i, p in zip(x, points):
        ax.text(i - 0.2, p["speedup_over_dense"], f"{p['speedup_over_dense']:.2f}x", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{p['retention_percent']}%" for p in points])
    ax.set_yscale("log")
    ax.set_xlabel("retention (attended keys / context)")
    ax.set_ylabel("speedup over dense decode attention")
    shape = report["shape"]
    ax.set_title(f"two-segment sparse attention, {report['device']}, batch {shape['batch']}, "
                 f"{shape['context'] // 1024}K, dense {report['dense_ms']:.3f} ms", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
