#!/usr/bin/env python3
"""Draws bench/decode_e2e_sfi.cc's JSON report as one PNG: per batch x context point and SFI
schedule (a slow step every N), decode throughput of dense and of SFI (left), and the step
times: dense, SFI fast, SFI slow with the maintenance overlapped and inline (right).
Usage: decode_e2e_sfi_plot.py --out plot.png report.json"""
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
    labels = [f"{p['batch']}x{p['context'] // 1024}K\nN={p['slow_every']}" for p in points]
    x = list(range(len(points)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(6 + 1.6 * len(points), 4.5))

    left.bar([i - 0.2 for i in x], [p["dense_tokens_per_s"] for p in points], 0.4, label="dense")
    left.bar([i + 0.2 for i in x], [p["sfi_tokens_per_s"] for p in points], 0.4, label="SFI")
    for i, p in zip(x, points):
        left.text(i + 0.2, p["sfi_tokens_per_s"], f"{p['sfi_over_dense']:.2f}x", ha="center",
                  va="bottom")
    left.set_xticks(x)
    left.set_xticklabels(labels)
    left.set_ylabel("tokens / s (whole cycles)")
    left.set_title("decode throughput")
    left.legend()

    width = 0.2
    series = [("dense_step_ms", "dense"), ("sfi_fast_step_ms", "SFI fast"),
              ("sfi_slow_step_ms", "SFI slow (overlap)"),
              ("sfi_slow_step_inline_ms", "SFI slow (inline)")]
    for k, (key, name) in enumerate(series):
        right.bar([i + (k - 1.5) * width for i in x], [p[key] for p in points], width, label=name)
    for i, p in zip(x, points):
        right.text(i + 0.5 * width, p["sfi_slow_step_ms"],
                   f"{p['slow_over_dense']:.2f}x\nhid {p['maintenance_hidden_fraction']:.2f}",
                   ha="center", va="bottom", fontsize=7)
    right.set_xticks(x)
    right.set_xticklabels(labels)
    right.set_ylabel("ms per decode step")
    right.set_title("step times")
    right.legend(fontsize=8)

    name = report["model"]["config"].split("/")[-1]
    sfi = report["sfi"]
    fig.suptitle(f"SFI vs dense, {name} (random weights), {report['device']}; sink "
                 f"{sfi['sink_tokens']}, recent {sfi['recent_window']}, budget {sfi['budget']}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
