#!/usr/bin/env python3
"""Writes the instances of the long-context accuracy suite (docs/design.md §7) as JSON lines.

One instance per (task, length bucket, depth, index) cell, drawn from tasks.py with the RNG
tasks.instance_rng(seed, ...) so that a larger --instances keeps the earlier instances. Token
counts are exact: a persistent `rubato tokenize --count` process counts every sentence with
the model's own tokenizer, and the whole prompt is counted again at the end. Each prompt is
sized a little under its bucket so that prompt + the longest continuation the runner asks for
(--max-new-tokens) fits: a prompt of the 8192 bucket has at most 8192 - max_new_tokens tokens.

Output lines: {"id", "task", "length", "depth", "index", "prompt", "answer",
"asked_char_offset" (code points into prompt where the asked fact starts), "prompt_tokens"}.

Example:
  bench/accuracy/generate.py --model models/tiny-qwen3-longctx \
      --rubato build/inference_rank/rubato --tasks passkey,multikey --lengths 2048,4096 \
      --depths 0,0.5,1 --instances 2 --out tasks.jsonl
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402  (the task formats the bundled model was trained on)

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# A sentence of filler is rarely longer than this many tokens; the first try aims this far
# under the budget so that the filler's last sentence usually does not overshoot it.
FIRST_TRY_SLACK = 48
MAX_TRIES = 8
# The suite's depth grid and generation allowance (bench/accuracy/run passes the same
# --max-new-tokens; tools/train_tiny/train_data.py sizes its suite-sized instances with both).
SUITE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
# 26: the longest answer is vartrack's 5 names of 5 capitals, at most 5 tokens each with its
# space ('ĠX' and every capital are in the byte-level BPE vocabulary, and BPE only merges), so
# 25 tokens, plus the '.' that ends it (24 could never hold some 5-name answers).
MAX_NEW_TOKENS = 26


class TokenCounter:
    """Exact token counts from a `rubato tokenize --count` subprocess, cached per text."""

    def __init__(self, rubato, model_dir):
        self.process = subprocess.Popen(
            [rubato, "tokenize", "--model", model_dir, "--count"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, encoding="utf-8", bufsize=1)
        self.cache = {}

    def __call__(self, text):
        count = self.cache.get(text)
        if count is None:
            self.process.stdin.write(json.dumps(text) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError("`rubato tokenize` ended early (see its error above)")
            count = int(line)
            if len(text) < 2000:  # sentences repeat; whole prompts do not
                self.cache[text] = count
        return count

    def close(self):
        self.process.stdin.close()
        if self.process.wait() != 0:
            raise RuntimeError(f"`rubato tokenize` exited with {self.process.returncode}")


def fit_instance(make, budget, count_tokens):
    """make(target_tokens) -> an instance whose facts do not depend on the target (a fresh RNG
    of the same seed each call); returns the one with the largest filler whose prompt has at
    most `budget` tokens (with its "prompt_tokens"), or None when 2 * MAX_TRIES do not fit.
    Shared with the training data (tools/train_tiny/train_data.py), which fits its
    suite-sized instances exactly as the suite does."""
    target = budget - FIRST_TRY_SLACK
    # Equal steps first (every suite instance so far fits in these, and keeps its filler);
    # then doubling steps, for a draw whose filler holds a sentence longer than the steps.
    for attempt in range(2 * MAX_TRIES):
        if attempt >= MAX_TRIES and target < 0:
            break  # the facts and the question alone do not fit
        instance = make(target)
        prompt_tokens = count_tokens(instance["prompt"])
        if prompt_tokens <= budget:
            instance["prompt_tokens"] = prompt_tokens
            return instance
        over = prompt_tokens - budget + 8
        target -= over if attempt < MAX_TRIES else over << (attempt - MAX_TRIES + 1)
    return None


def fitted_instance(task, seed, length, depth, index, budget, filler, words, count_tokens):
    """The cell's instance with the largest filler whose prompt has at most `budget` tokens."""
    instance = fit_instance(
        lambda target: tasks.make_instance(task, tasks.instance_rng(seed, task, length, depth,
                                                                    index),
                                           filler, words, target, depth, count_tokens),
        budget, count_tokens)
    if instance is None:
        raise RuntimeError(f"cannot fit {task} length {length} depth {depth} #{index} into "
                           f"{budget} tokens")
    return instance


def parse_list(text, convert, name):
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sys.exit(f"generate.py: error: --{name}: cannot parse '{text}'")
    if not values:
        sys.exit(f"generate.py: error: --{name} is empty")
    return values


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--instances", type=int, default=5, help="instances per (task, length, depth)")
    p.add_argument("--tasks", default=",".join(tasks.TASKS))
    p.add_argument("--lengths", default="2048,4096,8192", help="length buckets in tokens")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in SUITE_DEPTHS),
                   help="where the asked fact sits: 0 = start of the context, 1 = the end")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help="room left after the prompt in each bucket (the runner's limit)")
    p.add_argument("--context", type=int, default=8192, help="the model's context in tokens")
    p.add_argument("--model", required=True, help="model directory (its tokenizer.json)")
    p.add_argument("--rubato", required=True, help="path of the `rubato` binary")
    p.add_argument("--out", required=True, help="output .jsonl file")
    args = p.parse_args()

    task_names = parse_list(args.tasks, str.strip, "tasks")
    for task in task_names:
        if task not in tasks.TASKS:
            sys.exit(f"generate.py: error: unknown task '{task}' (known: {', '.join(tasks.TASKS)})")
    lengths = parse_list(args.lengths, int, "lengths")
    depths = parse_list(args.depths, float, "depths")
    if any(not 0 <= d <= 1 for d in depths):
        sys.exit("generate.py: error: --depths must lie in [0, 1] (fractions of the context)")
    if args.instances < 1:
        sys.exit("generate.py: error: --instances must be >= 1")
    for length in lengths:
        if length > args.context or length - args.max_new_tokens < 256:
            sys.exit(f"generate.py: error: length {length} does not fit the context "
                     f"({args.context}) with {args.max_new_tokens} new tokens")
    if not os.path.isfile(args.rubato):
        sys.exit(f"generate.py: error: no rubato binary at '{args.rubato}' (build it first)")

    filler = tasks.FillerText.from_file(os.path.join(DATA_DIR, "filler.txt"))
    with open(os.path.join(DATA_DIR, "words.txt"), encoding="utf-8") as f:
        words = [w.strip() for w in f if w.strip()]
    count_tokens = TokenCounter(args.rubato, args.model)
    written = 0
    with open(args.out, "w", encoding="utf-8") as out:
        for task in task_names:
            for length in lengths:
                budget = length - args.max_new_tokens
                for depth in depths:
                    for index in range(args.instances):
                        inst = fitted_instance(task, args.seed, length, depth, index, budget,
                                               filler, words, count_tokens)
                        record = {"id": f"{task}/{length}/{depth:g}/{index}", "task": task,
                                  "length": length, "depth": depth, "index": index,
                                  "prompt": inst["prompt"], "answer": inst["answer"],
                                  "asked_char_offset": inst["asked_char_offset"],
                                  "prompt_tokens": inst["prompt_tokens"]}
                        out.write(json.dumps(record, ensure_ascii=False) + "\n")
                        written += 1
    count_tokens.close()
    print(f"generate.py: wrote {written} instances to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
