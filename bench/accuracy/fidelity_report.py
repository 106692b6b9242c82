#!/usr/bin/env python3
"""Tables (markdown) and a plot (gnuplot PNG) from rubato_fidelity outputs (docs/fidelity.md):
accuracy with its 95 % Wilson interval, the guard's stats line, and per layer the share of the
dense attention mass each policy's rows kept at its sparse steps, and the part of the dense mass
on the asked chain's first fact and on its later facts that they kept; for an evicting policy
(LongFlow, measured by the dense twin), the share of each fact's rows its slots still held.

  fidelity_report.py [--png OUT.png] [--title TITLE] RUN.json[.gz]...
"""
import argparse
import gzip
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import wilson_interval  # noqa: E402  (the suite's one interval)
import json  # noqa: E402


def per_layer(run):
    """Per layer: mean kept share (over sparse steps and KV heads), and kept / dense of the chain
    mass on hop 0 and on hops 1.. (summed over sparse steps and KV heads)."""
    layers, heads = run["layers"], run["kv_heads"]
    share = [0.0] * layers
    hop = [[[0.0, 0.0] for _ in range(layers)] for _ in range(2)]  # [first, later][layer][d, k]
    steps = 0
    for instance in run["instances"]:
        for step in instance["steps"]:
            if step["dense"] or not step["measured"]:
                continue
            steps += 1
            for layer in range(layers):
                share[layer] += sum(step["share"][layer]) / heads
                for h, (dense, kept) in enumerate(zip(step["hop_dense"], step["hop_kept"])):
                    which = hop[0 if h == 0 else 1][layer]
                    which[0] += sum(dense[layer])
                    which[1] += sum(kept[layer])
    return steps, [s / steps if steps else float("nan") for s in share], hop


def by_hop(run):
    """Per hop index: at the sparse steps whose query puts the most dense chain mass on that hop
    (summed over layers and KV heads), the steps, the mean dense mass on it per (layer, KV head),
    the share kept, and the layers that lose most of it."""
    layers = run["layers"]
    rows = {}
    for instance in run["instances"]:
        for step in instance["steps"]:
            if step["dense"] or not step["measured"] or not step["hop_dense"]:
                continue
            totals = [sum(map(sum, hop)) for hop in step["hop_dense"]]
            h = max(range(len(totals)), key=totals.__getitem__)
            row = rows.setdefault(h, {"steps": 0, "dense": 0.0, "kept": 0.0,
                                      "lost": [0.0] * layers})
            row["steps"] += 1
            row["dense"] += totals[h]
            row["kept"] += sum(map(sum, step["hop_kept"][h]))
            for layer in range(layers):
                row["lost"][layer] += (sum(step["hop_dense"][h][layer]) -
                                       sum(step["hop_kept"][h][layer]))
    cells = layers * run["kv_heads"]
    out = []
    for h in sorted(rows):
        row = rows[h]
        worst = sorted(range(layers), key=lambda layer: -row["lost"][layer])[:3]
        lost = row["dense"] - row["kept"]
        share = ", ".join(f"{layer} ({row['lost'][layer] / lost:.0%})" for layer in worst) \
            if lost > 0 else "-"
        out.append(f"| {run['label']} | {h} | {row['steps']} | "
                   f"{row['dense'] / row['steps'] / cells:.3f} | "
                   f"{row['kept'] / row['dense']:.2f} | {share} |")
    return out


def held(run):
    """Evicting runs (steps with hop_held): per chain fact, the share of its rows the slots held
    (mean over layers and KV heads, then instances) at the first decode step (after the prompt's
    compression) and at the last; and per layer, that share over every fact, first step / last."""
    hops, layers_first, layers_last = {}, [], []
    for instance in run["instances"]:
        steps = [step for step in instance["steps"] if step.get("hop_held")]
        if not steps:
            continue
        first, last = steps[0]["hop_held"], steps[-1]["hop_held"]
        for h in range(len(first)):
            cells = [sum(map(sum, which[h])) / sum(map(len, which[h])) for which in (first, last)]
            hops.setdefault(h, []).append(cells)
        layers_first.append([sum(sum(f[layer]) / len(f[layer]) for f in first) / len(first)
                             for layer in range(run["layers"])])
        layers_last.append([sum(sum(f[layer]) / len(f[layer]) for f in last) / len(last)
                            for layer in range(run["layers"])])
    if not hops:
        return []
    out = ["", f"{run['label']}: the share of each chain fact's rows the slots held, first decode "
           "step / last (mean over layers, KV heads and instances).", "",
           "| fact | instances | held at the first step | held at the last |", "|---|---|---|---|"]
    for h in sorted(hops):
        rows = hops[h]
        out.append(f"| {h} | {len(rows)} | {sum(r[0] for r in rows) / len(rows):.2f} | "
                   f"{sum(r[1] for r in rows) / len(rows):.2f} |")
    out += ["", "| layer | chain rows held, first step | last step |", "|---|---|---|"]
    for layer in range(run["layers"]):
        out.append(f"| {layer} | {sum(r[layer] for r in layers_first) / len(layers_first):.2f} | "
                   f"{sum(r[layer] for r in layers_last) / len(layers_last):.2f} |")
    return out


def table(runs):
    out = ["| run | correct / n | accuracy [95 % CI] | sparse steps | guard |",
           "|---|---|---|---|---|"]
    for run in runs:
        low, high = wilson_interval(run["correct"], run["n"])
        guard = " ".join(part for part in run["stats"].split() if "guard" in part) or "off"
        steps = per_layer(run)[0]
        out.append(f"| {run['label']} | {run['correct']} / {run['n']} | "
                   f"{run['correct'] / run['n']:.2f} [{low:.2f}, {high:.2f}] | {steps} | "
                   f"{guard} |")
    out += ["", "Per layer: dense mass kept at sparse steps (mean over KV heads); of the dense "
            "mass on the chain's first fact / later facts, the share kept.", ""]
    out.append("| layer | " + " | ".join(run["label"] for run in runs) + " |")
    out.append("|---" * (len(runs) + 1) + "|")
    stats = [per_layer(run) for run in runs]
    for layer in range(runs[0]["layers"]):
        cells = []
        for _, share, hop in stats:
            ratio = [hop[i][layer][1] / hop[i][layer][0] if hop[i][layer][0] else float("nan")
                     for i in range(2)]
            cells.append(f"{share[layer]:.2f} ({ratio[0]:.2f} / {ratio[1]:.2f})")
        out.append(f"| {layer} | " + " | ".join(cells) + " |")
    out += ["", "By hop (vartrack): the steps whose query puts most of its chain mass on that fact "
            "(0 = the first, 'VAR A = value.').", "",
            "| run | hop | steps | dense mass on it (per layer x head) | kept | layers losing "
            "most of the lost part |", "|---|---|---|---|---|---|"]
    for run in runs:
        out += by_hop(run)
    for run in runs:
        out += held(run)
    return "\n".join(out)


def plot(runs, png, title):
    if shutil.which("gnuplot") is None:
        print("fidelity_report.py: gnuplot not found; no plot", file=sys.stderr)
        return
    data = png[:-len(".png")] + ".dat"
    stats = [per_layer(run)[1] for run in runs]
    with open(data, "w", encoding="utf-8") as f:
        f.write("layer " + " ".join(f'"{run["label"]}"' for run in runs) + "\n")
        for layer in range(runs[0]["layers"]):
            f.write(f"{layer} " + " ".join(f"{s[layer]:.4f}" for s in stats) + "\n")
    columns = ", ".join(f"'{data}' using 1:{i + 2} with linespoints title columnhead"
                        for i in range(len(runs)))
    script = "\n".join([
        "set terminal pngcairo size 760,420 font 'sans,10'",
        f"set output '{png}'",
        f"set title \"{title}\" noenhanced",
        "set xlabel 'layer'", "set ylabel 'dense attention mass kept'",
        "set yrange [0:1.02]", "set xtics 1", "set grid", "set key bottom left noenhanced",
        f"plot {columns}",
    ])
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    os.remove(data)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--png")
    parser.add_argument("--title", default="dense attention mass kept per layer")
    args = parser.parse_args()
    runs = []
    for path in args.runs:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            runs.append(json.load(f))
    print(table(runs))
    if args.png:
        plot(runs, args.png, args.title)


if __name__ == "__main__":
    main()
