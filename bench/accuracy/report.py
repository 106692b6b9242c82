#!/usr/bin/env python3
"""Merges rubato_accuracy outputs (one per policy) into bench/results/accuracy_<name>.json.gz,
prints the policy x task x length table with each cell's 95 % binomial interval (Wilson score)
and draws accuracy_<name>.png with gnuplot (one bar per policy in each task x length group).

  report.py --name NAME --out-dir bench/results --command "..." --meta KEY=VALUE ... RUN.json...
"""
import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys


def load_json(path):
    """A JSON file, gzip-compressed when its name ends in .gz."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def wilson_interval(correct, n, z=1.959964):
    """The 95 % Wilson score interval of a binomial proportion correct / n (no other
    dependencies; well behaved at 0 and n, unlike the normal approximation)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def merge(run_files, name, command, meta):
    runs = []
    for path in run_files:
        runs.append(load_json(path))
    summary = []
    for run in runs:
        for cell in run["summary"]:
            correct = round(cell["accuracy"] * cell["n"])
            low, high = wilson_interval(correct, cell["n"])
            summary.append({"label": run["label"], "policy": run["policy"], **cell,
                            "correct": correct, "ci95_low": round(low, 4),
                            "ci95_high": round(high, 4)})
    merged = {"name": name, "command": command, **meta,
              "device": runs[0]["device"] if runs else "unknown",
              "summary": summary, "runs": runs}
    return merged


def print_table(summary):
    print(f"{'policy':<22} {'task':<10} {'length':>6} {'accuracy':>8} {'95% interval':>14} "
          f"{'n':>4} {'kv_kept':>8}")
    for row in summary:
        interval = f"[{row['ci95_low']:.2f}, {row['ci95_high']:.2f}]"
        print(f"{row['label']:<22} {row['task']:<10} {row['length']:>6} "
              f"{row['accuracy']:>8.3f} {interval:>14} {row['n']:>4} "
              f"{row['mean_retained_kv_ratio']:>8.3f}")


def plot(summary, png_path, title):
    """Clustered bars: x = task/length groups, one bar per policy label."""
    if shutil.which("gnuplot") is None:
        print("report.py: gnuplot not found (scripts/setup installs gnuplot-nox); no plot",
              file=sys.stderr)
        return False
    labels = list(dict.fromkeys(row["label"] for row in summary))
    groups = list(dict.fromkeys((row["task"], row["length"]) for row in summary))
    accuracy = {(row["label"], row["task"], row["length"]): row["accuracy"] for row in summary}
    data_path = png_path[:-len(".png")] + ".dat"
    with open(data_path, "w", encoding="utf-8") as f:
        f.write("group " + " ".join(labels) + "\n")
        for task, length in groups:
            values = [accuracy.get((label, task, length)) for label in labels]
            f.write(f"{task}/{length // 1024}K " +
                    " ".join("NaN" if v is None else f"{v:.4f}" for v in values) + "\n")
    columns = ", ".join(f"'{data_path}' using {i + 2}:xtic(1) title columnhead"
                        for i in range(len(labels)))
    script = "\n".join([
        "set terminal pngcairo size 1200,520 font 'sans,10'",
        f"set output '{png_path}'",
        f"set title \"{title}\" noenhanced",
        "set style data histograms",
        "set style histogram clustered gap 1",
        "set style fill solid 0.85 border -1",
        "set boxwidth 0.9",
        "set yrange [0:1.05]",
        "set ylabel 'accuracy (exact match)'",
        "set xtics rotate by -35 noenhanced",
        "set key outside top right noenhanced",
        "set grid ytics",
        f"plot {columns}",
    ])
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    os.remove(data_path)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--command", required=True, help="the command line that produced the runs")
    p.add_argument("--meta", action="append", default=[], help="KEY=VALUE recorded as is")
    p.add_argument("runs", nargs="+", help="rubato_accuracy output files")
    args = p.parse_args()
    meta = dict(item.split("=", 1) for item in args.meta)
    merged = merge(args.runs, args.name, args.command, meta)
    os.makedirs(args.out_dir, exist_ok=True)
    # Per-instance records: compressed (a run of the suite is 0.1-0.8 MB of JSON).
    json_path = os.path.join(args.out_dir, f"accuracy_{args.name}.json.gz")
    with gzip.open(json_path, "wt", encoding="utf-8") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    print_table(merged["summary"])
    png_path = os.path.join(args.out_dir, f"accuracy_{args.name}.png")
    title = f"rubato accuracy '{args.name}' ({merged.get('model', '')}, {merged['device']})"
    drawn = plot(merged["summary"], png_path, title)
    print(f"wrote {json_path}" + (f" and {png_path}" if drawn else ""))


if __name__ == "__main__":
    main()
