#!/usr/bin/env python3
"""Compares the answers of two rubato_accuracy outputs over the same instances (e.g. the CPU
engine against the CUDA engine): per instance, whether the predictions are equal, and every
instance where they differ with both predictions and the answer. Writes the comparison as
JSON with --out; exits 1 when fewer than --min-same instances agree (default: all of them).

  compare.py RUN_A.json RUN_B.json [--out FILE] [--min-same N] [--command "..."]
"""
import argparse
import gzip
import json
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        run = json.load(f)
    return run, {inst["id"]: inst for inst in run["instances"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--out")
    p.add_argument("--min-same", type=int, default=-1,
                   help="instances that must agree (default: every one)")
    p.add_argument("--command", default="", help="recorded in the JSON")
    args = p.parse_args()
    run_a, a = load(args.a)
    run_b, b = load(args.b)
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))[:5]
        sys.exit(f"compare.py: error: the runs hold different instances (e.g. {only})")
    differ = []
    for key in sorted(a):
        if a[key]["prediction"] != b[key]["prediction"]:
            differ.append({"id": key, "answer": a[key]["answer"],
                           "a": a[key]["prediction"], "b": b[key]["prediction"],
                           "a_correct": a[key]["correct"], "b_correct": b[key]["correct"]})
    same = len(a) - len(differ)
    correct_a = sum(inst["correct"] for inst in a.values())
    correct_b = sum(inst["correct"] for inst in b.values())
    result = {"command": args.command, "instances": len(a), "same_prediction": same,
              "a": {"file": args.a, "backend": run_a.get("backend"), "device": run_a["device"],
                    "policy": run_a["policy"], "correct": correct_a},
              "b": {"file": args.b, "backend": run_b.get("backend"), "device": run_b["device"],
                    "policy": run_b["policy"], "correct": correct_b},
              "differ": differ}
    print(f"{same}/{len(a)} instances give the same prediction; correct: "
          f"{correct_a} ({run_a.get('backend')}) vs {correct_b} ({run_b.get('backend')})")
    for d in differ:
        print(f"  {d['id']}: answer {d['answer']!r}, {d['a']!r} vs {d['b']!r}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    need = len(a) if args.min_same < 0 else args.min_same
    return 0 if same >= need else 1


if __name__ == "__main__":
    sys.exit(main())
