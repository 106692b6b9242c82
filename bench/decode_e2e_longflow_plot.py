#!/usr/bin/env python3
"""Draws bench/decode_e2e_longflow.cc's JSON report as a PNG with gnuplot (Debian gnuplot-nox):
the step time of dense and LongFlow against the context, each at its own maximum batch, with the
batches and the tokens/s over the whole generation in the key.
Usage: decode_e2e_longflow_plot.py --out plot.png report.json"""
import argparse
import json
import subprocess


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("report")
    args = parser.parse_args()
    report = json.load(open(args.report))
    data, plots = [], []
    for index, side in enumerate(("dense", "longflow")):
        run = report[side]
        rows = "\n".join(f"{c / 1024:.3f} {ms:.4f}" for c, ms in zip(run["contexts"], run["step_ms"]))
        data.append(f"${side} << EOD\n{rows}\nEOD")
        plots.append(f"${side} using 1:2 with linespoints lw 2 pt 7 title "
                     f"\"{side}, batch {run['batch']}: {run['tokens_per_s']:.0f} tok/s\"")
    title = (f"prompt {report['prompt']}, output {report['output']}, B = "
             f"{report['longflow']['budget']}: LongFlow "
             f"{report['longflow_over_dense_tokens_per_s']:.2f}x dense tokens/s "
             f"({report['device']}, {report['commit']})")
    script = "\n".join(data + [
        "set terminal pngcairo size 900,450",
        f"set output \"{args.out}\"",
        f"set title \"{title}\"",
        "set xlabel \"context (K tokens)\"",
        "set ylabel \"ms per decode step (the whole batch)\"",
        "set grid",
        "set key right bottom box opaque",
        "set yrange [0:*]",
        "plot " + ", ".join(plots),
    ])
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


if __name__ == "__main__":
    main()
