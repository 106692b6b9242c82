#!/usr/bin/env python3
"""Pools accuracy reports of independent draws (bench/results/accuracy_<name>.json.gz written with
different --seed values) per policy x task x length and prints one markdown table of the pooled
accuracy with its 95 % Wilson interval, for estimates tighter than one draw's 25 a cell.

  pool.py [--label dense] REPORT.json.gz REPORT.json.gz ...

Refuses, naming the file: two reports of the same seed (the same instances counted twice),
reports of different models, and a label missing from a report.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (the suite's Wilson interval)

TASKS = ("passkey", "multikey", "kv_recall", "vartrack")


def load(paths, label):
    """(seeds, model, {(task, length): [correct, n]}) of the label's cells over the reports."""
    cells, seeds, model = {}, {}, None
    for path in paths:
        data = report.load_json(path)
        seed = data.get("seed")
        if seed is None:
            raise ValueError(f"{path}: no 'seed' (not an accuracy report of bench/accuracy/run)")
        if seed in seeds:
            raise ValueError(f"{path}: seed {seed} is also {seeds[seed]}'s: the same instances "
                             f"would be counted twice")
        seeds[seed] = path
        if model is None:
            model = data.get("model")
        elif data.get("model") != model:
            raise ValueError(f"{path}: model {data.get('model')!r}, the others {model!r}")
        rows = [r for r in data.get("summary", []) if r.get("label") == label]
        if not rows:
            raise ValueError(f"{path}: no cells of label {label!r}")
        for r in rows:
            cell = cells.setdefault((r["task"], int(r["length"])), [0, 0])
            cell[0] += int(r["correct"])
            cell[1] += int(r["n"])
    return sorted(seeds), model, cells


def table(cells):
    lengths = sorted({length for _, length in cells})
    lines = ["| task | " + " | ".join(f"{n // 1024}K" if n % 1024 == 0 else str(n)
                                     for n in lengths) + " |",
             "|---" * (len(lengths) + 1) + "|"]
    for task in [t for t in TASKS if any(k[0] == t for k in cells)]:
        out = []
        for length in lengths:
            if (task, length) not in cells:
                out.append("-")
                continue
            correct, n = cells[(task, length)]
            low, high = report.wilson_interval(correct, n)
            out.append(f"{correct / n:.2f} [{low:.2f}, {high:.2f}] ({correct}/{n})")
        lines.append(f"| {task} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default="dense", help="the policy label to pool (default dense)")
    p.add_argument("reports", nargs="+")
    args = p.parse_args()
    try:
        seeds, model, cells = load(args.reports, args.label)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"pool.py: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.label} on {model}, seeds {', '.join(map(str, seeds))} pooled:\n")
    print(table(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
