#!/usr/bin/env python3
"""Writes the default development set of policy calibration (`rubato calibrate kascade
--dev-set`): JSON lines {"prompt": ...}, each about --tokens tokens long. Half the prompts are
retrieval instances in the accuracy suite's formats (bench/accuracy/tasks.py), so that the
attention the calibration observes includes the long-range lookups the suite asks for; the
rest are plain text. Every filler sentence comes from the training corpus
(.cache/corpus/train.txt from tools/train_tiny/extract_corpus.sh), never from the suite's
held-out filler (bench/accuracy/data/filler.txt). Deterministic in --seed.

  python3 tools/calibration/make_dev_set.py --out tools/calibration/kascade_dev_set.jsonl
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "accuracy"))
import tasks  # noqa: E402

CHARS_PER_TOKEN = 3.5  # sizes the prompts; the calibrator cuts to --max-tokens anyway


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=".cache/corpus/train.txt")
    p.add_argument("--words", default="bench/accuracy/data/words.txt")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1800)
    p.add_argument("--seed", type=int, default=20261125)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(args.corpus, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    held_out = set()
    with open("bench/accuracy/data/filler.txt", encoding="utf-8") as f:
        held_out = {line.rstrip("\n") for line in f if line.strip()}
    lines = [line for line in lines if line not in held_out]
    words = open(args.words, encoding="utf-8").read().split()
    filler = tasks.FillerText(lines)
    counter = tasks.chars_counter(CHARS_PER_TOKEN)
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as out:
        for i in range(args.prompts):
            if i % 2 == 0:
                task = tasks.TASKS[(i // 2) % len(tasks.TASKS)]
                inst = tasks.make_instance(task, rng, filler, words, args.tokens, rng.random(),
                                           counter)
                prompt = inst["prompt"] + " " + inst["answer"] + "."
            else:
                prompt = " ".join(filler.run(rng, args.tokens, counter))
            out.write(json.dumps({"prompt": prompt}) + "\n")
    print(f"make_dev_set.py: wrote {args.prompts} prompts to {args.out}")


if __name__ == "__main__":
    main()
