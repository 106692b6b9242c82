#!/usr/bin/env python3
"""Per-kernel time of one decode step from Nsight Compute's CSV (docs/benchmarks.md "Where a
decode step's time goes"). Profile the steps a benchmark brackets with cudaProfilerStart/Stop:

  ncu --profile-from-start off --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --page raw --log-file K.csv \
      rubato_bench_decode_e2e --config configs/models/qwen3-8b --points 1x4096 \
      --steps 20 --warmup 3 --profile-steps 2 --out E.json
  python3 bench/kernel_breakdown.py --csv K.csv --steps 2 --e2e E.json --out B.json

ncu runs kernels one at a time, so the sum is kernel time without overlap; the benchmark's own
step time (from --e2e, measured without the profiler) minus that sum is what launches, gaps and
tails between kernels cost.
"""
import argparse
import csv
import json
import re
import sys
from collections import defaultdict

# First match wins; the names are this repository's kernels and cuBLASLt's.
CATEGORIES = [
    ("gemm", r"gemm|nvjet|xmma|cutlass|Kernel2|splitK"),
    ("attention_merge", r"AttentionMerge"),
    ("attention", r"Attention|attention"),
    ("norm", r"RmsNorm"),
    ("rope", r"Rope"),
    ("kv_append", r"AppendToPagedKv|AppendHeadMajor"),
    ("swiglu", r"SwiGlu"),
    ("sampling", r"Sample|Logit|Argmax|TopK|Gather"),
    ("embedding", r"Embedding"),
]


def category(name):
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def read_kernels(path):
    """(name, grid, microseconds) per profiled kernel, in launch order."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are unquoted
    rows = list(csv.reader(lines))
    header = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    columns = rows[header]
    name_at = columns.index("Kernel Name")
    grid_at = columns.index("Grid Size") if "Grid Size" in columns else None
    time_at = columns.index("gpu__time_duration.sum")
    unit = "nsecond"
    kernels = []
    for row in rows[header + 1:]:
        if len(row) <= time_at:
            continue
        value = row[time_at].replace(",", "")
        try:
            duration = float(value)
        except ValueError:
            unit = value or unit  # the units row
            continue
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
        kernels.append((row[name_at], row[grid_at] if grid_at is not None else "",
                        duration * scale))
    return kernels


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", required=True, help="ncu --csv --page raw output")
    parser.add_argument("--steps", type=int, required=True, help="steps the profile holds")
    parser.add_argument("--e2e", help="the benchmark's JSON: its step time for the gap")
    parser.add_argument("--point", type=int, default=0, help="which point of --e2e")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    kernels = read_kernels(args.csv)
    if not kernels:
        sys.exit(f"{args.csv}: no kernel rows with gpu__time_duration.sum")
    by_category = defaultdict(lambda: [0.0, 0])
    by_kernel = defaultdict(lambda: [0.0, 0])
    for name, grid, us in kernels:
        by_category[category(name)][0] += us
        by_category[category(name)][1] += 1
        short = re.sub(r"\(.*", "", name)[:90]
        by_kernel[(short, grid)][0] += us
        by_kernel[(short, grid)][1] += 1
    steps = args.steps
    total_us = sum(us for _, _, us in kernels) / steps
    report = {
        "csv": args.csv,
        "steps": steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_us_per_step": total_us,
        "categories": {label: {"us_per_step": t / steps, "kernels_per_step": n / steps,
                               "share": t / steps / total_us}
                       for label, (t, n) in sorted(by_category.items(), key=lambda x: -x[1][0])},
        "top_kernels": [{"kernel": k, "grid": g, "us_per_step": t / steps,
                         "calls_per_step": n / steps, "us_per_call": t / n}
                        for (k, g), (t, n) in sorted(by_kernel.items(),
                                                     key=lambda x: -x[1][0])[:args.top]],
    }
    if args.e2e:
        with open(args.e2e) as f:
            e2e = json.load(f)
        point = e2e["points"][args.point]
        step_us = point["step_ms_median"] * 1e3
        report["point"] = {k: point[k] for k in ("batch", "context", "step_ms_median",
                                                 "roofline_ms", "ratio_to_roofline")}
        report["device"] = e2e.get("device")
        report["commit"] = e2e.get("commit")
        report["step_us"] = step_us
        report["gap_us_per_step"] = step_us - total_us
        report["roofline_us"] = point["roofline_ms"] * 1e3
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(kernels) / steps:.0f} kernels/step, {total_us:.1f} us of kernels/step"
          + (f", step {report['step_us']:.1f} us, gap {report['gap_us_per_step']:.1f} us,"
             f" roofline {report['roofline_us']:.1f} us" if args.e2e else ""))
    for label, c in report["categories"].items():
        print(f"  {label:16s} {c['us_per_step']:9.1f} us  {c['kernels_per_step']:6.1f} kernels"
              f"  {100 * c['share']:5.1f} %")
    for k in report["top_kernels"][:10]:
        print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:5.1f}  {k['us_per_call']:7.2f}"
              f" us/call  {k['kernel'][:70]} {k['grid']}")


if __name__ == "__main__":
    main()
