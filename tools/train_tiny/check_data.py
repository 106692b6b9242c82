#!/usr/bin/env python3
"""Checks the training rows of tools/train_tiny/train_data.py (no torch, no GPU): generates
--rows rows of each new kind with the committed tokenizer and asserts their properties.

  kv        kv_recall rows with --kv-letter-first 0.6 and the first-answer-token weight: the
            letter-first share of the values asked, weight 3 on exactly one token per instance;
  vartrack  vartrack rows with --vartrack-hard-share 0.5: half the instances hard, each hard one
            with >= 2 distractor facts inside the asked chain's span and depth <= 0.3 or 4 hops;
  suite     rows starting with a suite-sized instance (--suite-share 1 here): at position 0,
            fitted as the suite fits it (prompt <= length - max_new_tokens, counted exactly),
            depth within 0.05 of the suite's grid; and the share of such rows for 0.3.
For every instance of every row: prompt, answer and <|endoftext|> lie whole in the row, the
row's ids are exactly the tokenizer's ids of the prompt (no front cut, the asked fact is in
it), every row is exactly --row-tokens + 1 long and a pure function of (seed, phase, index).
Also: the suite's generator (bench/accuracy/tasks.py with its default options) still makes the
instances it made before the training options were added (a digest), the suite's longest
answers fit its max_new_tokens, and the quick accuracy's instances follow the suite's protocol.

Token ids come from `rubato tokenize --model MODEL` (--rubato PATH, what the suite's generate.py
uses), or from the `tokenizers` Python package when it is installed and --rubato is not given.

  tools/train_tiny/check_data.py --rubato build/inference_rank/rubato [--rows 200]
"""
import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import train_data  # noqa: E402
from train_data import generate, tasks  # noqa: E402

# sha256 over the prompt, answer and asked_char_offset of 1200 instances of the suite's
# generator (seeds 0, 1, 7 x 4 tasks x 2K-16K x the 5 depths x 5, characters / 3.5 as the
# counter), as made by bench/accuracy/tasks.py before its training-only options existed.
SUITE_DIGEST = "4b6ea62bad6988a7060217ecd1775fe469567bee419d29ae5cb92c2dc9e6a47d"


class RubatoEncoder:
    """encode(text) -> ids through one `rubato tokenize` process (JSON string in, ids out)."""

    def __init__(self, rubato, model_dir):
        self.process = subprocess.Popen(
            [rubato, "tokenize", "--model", model_dir], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, encoding="utf-8", bufsize=1)

    def __call__(self, text):
        self.process.stdin.write(json.dumps(text) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("`rubato tokenize` ended early (see its error above)")
        return json.loads(line)

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def make_encoder(args):
    if args.rubato:
        return RubatoEncoder(args.rubato, args.model), "rubato tokenize"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("check_data.py: no tokenizer: pass --rubato PATH (a built rubato) or install "
                 "the `tokenizers` Python package")
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    return (lambda text: tok.encode(text).ids), "tokenizers"


def suite_digest():
    filler = tasks.FillerText.from_file(os.path.join(ROOT, "bench/accuracy/data/filler.txt"))
    words = train_data.read_words(os.path.join(ROOT, "bench/accuracy/data/words.txt"))
    count = tasks.chars_counter(3.5)
    h = hashlib.sha256()
    for seed in (0, 1, 7):
        for task in tasks.TASKS:
            for length in (2048, 4096, 8192, 16384):
                for depth in generate.SUITE_DEPTHS:
                    for i in range(5):
                        inst = tasks.make_instance(
                            task, tasks.instance_rng(seed, task, length, depth, i), filler,
                            words, length - 48, depth, count)
                        h.update(json.dumps([inst["prompt"], inst["answer"],
                                             inst["asked_char_offset"]]).encode())
    return h.hexdigest()


class Failures:
    def __init__(self):
        self.items = []

    def check(self, ok, what):
        if not ok:
            self.items.append(what)
            if len(self.items) <= 20:
                print("FAIL:", what)


def check_rows(kind, maker, encode, eos, rows, row_tokens, fails):
    """Makes `rows` rows, checks every document of them; returns the task documents."""
    docs_all, unfitted = [], [0]
    for r in range(rows):
        docs = []
        ids, weights = maker.make_row(r, docs)
        fails.check(len(ids) == len(weights) == row_tokens + 1,
                    f"{kind} row {r}: {len(ids)} ids, {len(weights)} weights")
        fails.check(min(weights) >= train_data.TEXT, f"{kind} row {r}: a padding weight")
        end = 0
        for d in docs:
            fails.check(d["start"] == end, f"{kind} row {r}: document at {d['start']}, not {end}")
            if d["kind"] == "text":
                end = d["start"] + d["ids"]
                continue
            if d["kind"] == "unfitted":
                unfitted[0] += 1
                continue
            where = f"{kind} row {r} {d['kind']} {d['task']} at {d['start']}"
            prompt = encode(d["prompt"])
            answer = encode(" " + d["answer"] + ".")
            s, p, a = d["start"], len(prompt), len(answer)
            fails.check(p == d["prompt_ids"] and a == d["answer_ids"], f"{where}: counts differ")
            fails.check(s + p + a + 1 <= row_tokens + 1, f"{where}: runs past the row")
            fails.check(ids[s:s + p] == prompt, f"{where}: the row's prompt ids are not the "
                                                f"prompt's (cut?)")
            fails.check(ids[s + p:s + p + a] == answer and ids[s + p + a] == eos,
                        f"{where}: answer or <|endoftext|> missing")
            fails.check(weights[s:s + p] == [train_data.TEXT] * p,
                        f"{where}: prompt weights")
            fails.check(weights[s + p:s + p + a] ==
                        [train_data.FIRST_ANSWER] + [train_data.ANSWER] * (a - 1),
                        f"{where}: answer weights")
            off = d["asked_char_offset"]
            fails.check(d["prompt"][off:off + len(d["asked_fact"])] == d["asked_fact"],
                        f"{where}: the asked fact is not at its offset")
            body = d["prompt"].rsplit("\n", 1)[0]
            if d["task"] == "vartrack":
                fails.check(all(f"VAR {name} =" in body for name in d["answer"].split()),
                            f"{where}: a chain variable is missing")
            else:
                fails.check(d["answer"] in d["asked_fact"] and d["asked_fact"] in body,
                            f"{where}: the asked fact is not in the text")
            # Tokens from the asked fact to the end of the prompt (the question's distance).
            d["asked_distance"] = p - len(encode(d["prompt"][:off])) if off else p
            end = s + p + a + 1
            docs_all.append(d)
        fails.check(end >= row_tokens + 1 or docs[-1]["kind"] == "unfitted",
                    f"{kind} row {r}: documents end at {end}")
    print(f"{kind}: {unfitted[0]} instances did not fit the room left in their row (text "
          f"instead)")
    # Pure function of (seed, phase, index): a fresh maker gives the same row.
    again = train_data.RowMaker(maker.encode, eos, maker.lines, maker.words, maker.options)
    fails.check(again.make_row(rows - 1) == maker.make_row(rows - 1),
                f"{kind}: row {rows - 1} differs when made again")
    return docs_all


def describe(kind, docs, rows):
    """One line: instances, unfitted ones, how far the asked facts lie from the question."""
    tasks_docs = [d for d in docs if d["kind"] in ("task", "suite")]
    far = [d["asked_distance"] for d in tasks_docs]
    print(f"{kind}: {rows} rows, {len(tasks_docs)} instances; asked fact > 8K tokens before the "
          f"question: {sum(x > 8192 for x in far) / max(1, len(far)):.3f}, > 12K: "
          f"{sum(x > 12288 for x in far) / max(1, len(far)):.3f}, farthest {max(far, default=0)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rubato", default=None, help="a built rubato binary (its `tokenize`)")
    p.add_argument("--model", default=os.path.join(ROOT, "models/tiny-qwen3-longctx"),
                   help="model folder of the tokenizer (the yardstick's is the same)")
    p.add_argument("--corpus", default=None,
                   help="training text (default .cache/corpus/train.txt(.gz) when present, "
                        "else the suite's filler, which only stands in for it here)")
    p.add_argument("--rows", type=int, default=200, help="rows of each kind")
    p.add_argument("--row-tokens", type=int, default=16384)
    args = p.parse_args()
    t0 = time.time()
    fails = Failures()

    digest = suite_digest()
    fails.check(digest == SUITE_DIGEST, f"the suite's instances changed (digest {digest})")
    print(f"suite generator unchanged: {digest == SUITE_DIGEST}")

    encode, backend = make_encoder(args)
    with open(os.path.join(args.model, "tokenizer.json"), encoding="utf-8") as f:
        eos = next(t["id"] for t in json.load(f)["added_tokens"]
                   if t["content"] == "<|endoftext|>")
    corpus = args.corpus
    if corpus is None:
        for candidate in (".cache/corpus/train.txt.gz", ".cache/corpus/train.txt",
                          "bench/accuracy/data/filler.txt"):
            if os.path.exists(os.path.join(ROOT, candidate)):
                corpus = os.path.join(ROOT, candidate)
                break
    lines = train_data.read_lines(corpus)
    words = train_data.read_words(os.path.join(ROOT, "bench/accuracy/data/words.txt"))
    print(f"tokenizer: {backend} ({args.model}); corpus {corpus} ({len(lines)} lines); "
          f"{args.rows} rows of {args.row_tokens} + 1 tokens per kind")

    # The suite's longest answers fit its max_new_tokens (the answer and its '.').
    longest = {}
    for seed in (0, 1):
        for task in tasks.TASKS:
            for length in (2048, 4096, 8192, 16384):
                for depth in generate.SUITE_DEPTHS:
                    for i in range(25):
                        _, _, _, answer = tasks._facts(
                            task, tasks.instance_rng(seed, task, length, depth, i), words)
                        n = len(encode(" " + answer + "."))
                        longest[task] = max(longest.get(task, 0), n)
    print(f"longest suite answer + '.' in tokens (seeds 0, 1; 25 per cell): {longest}; "
          f"max_new_tokens {train_data.MAX_NEW_TOKENS}")
    fails.check(max(longest.values()) <= train_data.MAX_NEW_TOKENS,
                f"a suite answer needs {max(longest.values())} > {train_data.MAX_NEW_TOKENS}")
    worst = " " + " ".join(["QXZJV"] * 5) + "."  # 5 names; no name exceeds 'Ġ'+letter + 4
    fails.check(len(encode(worst)) <= train_data.MAX_NEW_TOKENS,
                f"a 5-name answer can need {len(encode(worst))} tokens")

    def options(**kw):
        return train_data.DataOptions(seed=20261121, phase="check", row_tokens=args.row_tokens,
                                      task_share=0.95, short_share=0.4, **kw)

    # kv: letter-first values and the first-answer-token weight.
    t = time.time()
    kv = check_rows("kv", train_data.RowMaker(encode, eos, lines, words, options(
        task_weights={"kv_recall": 1.0}, kv_letter_first=0.6)), encode, eos, args.rows,
        args.row_tokens, fails)
    describe("kv", kv, args.rows)
    share = sum(d["answer"][0] in "abcdef" for d in kv) / max(1, len(kv))
    print(f"kv: {len(kv)} kv_recall instances, letter-first share {share:.3f} (asked values; "
          f"the suite's draw: {6 / 16:.3f}) ({time.time() - t:.0f}s)")
    fails.check(len(kv) >= args.rows and 0.5 <= share <= 0.7, f"kv letter-first share {share}")

    # vartrack: hard instances.
    t = time.time()
    vt = check_rows("vartrack", train_data.RowMaker(encode, eos, lines, words, options(
        task_weights={"vartrack": 1.0}, vartrack_hard_share=0.5)), encode, eos, args.rows,
        args.row_tokens, fails)
    describe("vartrack", vt, args.rows)
    hard = [d for d in vt if d["options"].get("vartrack_span_distractors")]
    easy = [d for d in vt if not d["options"].get("vartrack_span_distractors")]
    for d in hard:
        fails.check(d["span_distractors"] >= 2 and (d["depth"] <= 0.3 or d["hops"] == 4),
                    f"hard vartrack: {d['span_distractors']} in span, depth {d['depth']:.2f}, "
                    f"{d['hops']} hops")
    hist = {}
    for d in hard:
        hist[d["span_distractors"]] = hist.get(d["span_distractors"], 0) + 1
    hard_share = len(hard) / max(1, len(vt))
    easy_span = sum(d["span_distractors"] >= 2 for d in easy) / max(1, len(easy))
    print(f"vartrack: {len(vt)} instances, hard share {hard_share:.3f}; hard: distractors in "
          f"span {dict(sorted(hist.items()))}, depth <= 0.3: "
          f"{sum(d['depth'] <= 0.3 for d in hard)}, 4 hops: {sum(d['hops'] == 4 for d in hard)}"
          f"; other instances with >= 2 in span: {easy_span:.3f} ({time.time() - t:.0f}s)")
    fails.check(len(vt) >= args.rows and 0.4 <= hard_share <= 0.6, f"hard share {hard_share}")

    # vartrack: the distractor chain in order and opening first, for the instances not hard.
    first = check_rows("vartrack-first", train_data.RowMaker(encode, eos, lines, words, options(
        task_weights={"vartrack": 1.0}, vartrack_hard_share=0.5,
        vartrack_distractor_first_share=1.0)), encode, eos, 10, args.row_tokens, fails)
    marked = [d for d in first if d["kind"] == "task" and
              d["options"].get("vartrack_distractor_first")]
    fails.check(marked and all(d["distractor_first"] for d in marked),
                "distractor-first vartrack: not in order first")
    fails.check(all(not d["options"].get("vartrack_distractor_first") for d in first
                    if d["kind"] == "task" and d["options"].get("vartrack_span_distractors")),
                "distractor-first vartrack: mixed with span distractors")
    natural = sum(d["distractor_first"] for d in easy) / max(1, len(easy))
    print(f"vartrack: {len(marked)} distractor-first instances, all in order and opening first; "
          f"without the option {natural:.3f} of the instances not hard are")

    # suite: one suite-sized instance at position 0 of every row (share 1 here).
    t = time.time()
    o = options(kv_letter_first=0.6, suite_share=1.0)
    maker = train_data.RowMaker(encode, eos, lines, words, o)
    docs = check_rows("suite", maker, encode, eos, args.rows, args.row_tokens, fails)
    describe("suite", docs, args.rows)
    suite = [d for d in docs if d["kind"] == "suite"]
    fails.check(len(suite) == args.rows and all(d["start"] == 0 for d in suite),
                f"{len(suite)} suite-sized instances for {args.rows} rows")
    slack = []
    for d in suite:
        where = f"suite {d['task']}@{d['length']} depth {d['depth']:.3f}"
        fails.check(d["length"] in o.suite_lengths, f"{where}: length")
        fails.check(d["prompt_tokens"] == d["prompt_ids"] <= d["budget"] ==
                    d["length"] - train_data.MAX_NEW_TOKENS, f"{where}: not fitted exactly")
        fails.check(abs(d["depth"] - d["grid_depth"]) <= train_data.SUITE_DEPTH_JITTER + 1e-9,
                    f"{where}: depth off the grid")
        slack.append(d["budget"] - d["prompt_ids"])
    by = {}
    for d in suite:
        by[(d["task"], d["length"])] = by.get((d["task"], d["length"]), 0) + 1
    print(f"suite: {len(suite)} suite-sized instances at position 0; budget - prompt tokens: "
          f"min {min(slack)}, max {max(slack)}, mean {sum(slack) / len(slack):.1f}; per task x "
          f"length {dict(sorted(by.items()))} ({time.time() - t:.0f}s)")
    # --suite-depths / --suite-task-weights: the suite-sized instances only, the rest unchanged.
    o = options(suite_share=1.0, suite_depths=(0.0, 0.25), suite_task_weights={"vartrack": 1})
    maker = train_data.RowMaker(encode, eos, lines, words, o)
    docs = check_rows("suite-focus", maker, encode, eos, 8, args.row_tokens, fails)
    focus = [d for d in docs if d["kind"] == "suite"]
    fails.check(len(focus) == 8 and all(d["task"] == "vartrack" and d["grid_depth"] in
                                        (0.0, 0.25) for d in focus),
                f"suite focus: {[(d['task'], d['grid_depth']) for d in focus]}")
    fails.check(len({d["task"] for d in docs if d["kind"] == "task"}) > 1,
                "suite focus: the other instances keep --task-weights")
    share = sum(random.Random(f"{options().row_prefix}/{r}/suite").random() < 0.3
                for r in range(10000)) / 10000
    print(f"suite: rows with a suite-sized instance at --suite-share 0.3: {share:.3f}")
    fails.check(0.28 <= share <= 0.32, f"suite share {share}")

    # --alt-share's schedule: the share of steps, evenly spread, and a resumed run's two
    # stream positions equal to a single run's.
    for alt_share in (0.5, 1 / 3, 0.25, 0.0, 1.0):
        is_alt = [train_data.is_alt_step(s, alt_share) for s in range(1200)]
        fails.check(sum(is_alt) == round(1200 * alt_share), f"alt share {alt_share}: "
                    f"{sum(is_alt)} of 1200 steps")
        if 0 < alt_share < 1:
            gap = max(len(run) for run in "".join("a" if a else "m" for a in is_alt).split("a"))
            fails.check(gap <= math.ceil(1 / alt_share), f"alt share {alt_share}: {gap} main "
                        "steps in a row")
        for step in (0, 7, 100, 1199):
            fails.check(train_data.alt_steps_before(step, alt_share) == sum(is_alt[:step]),
                        f"alt share {alt_share}: resume at {step}")
    print("alt schedule: shares 0.5, 1/3, 0.25, 0, 1 over 1200 steps checked")

    # The quick accuracy's instances: the suite's (seed 0, 5 depths) fitted to length - 26.
    count = train_data.CachedCounter(encode)
    filler = tasks.FillerText.from_file(os.path.join(ROOT, "bench/accuracy/data/filler.txt"))
    outcomes = []
    for task in tasks.TASKS:
        insts = train_data.eval_instances(task, 4096, 0, train_data.SUITE_DEPTHS, 1, filler,
                                          words, count)
        for inst in insts:
            fails.check(len(encode(inst["prompt"])) == inst["prompt_tokens"] <=
                        4096 - train_data.MAX_NEW_TOKENS, f"eval {task}: not fitted")
            outcomes.append((task, 4096, inst["depth"], inst["answer"][0] in "0123456789"))
    print("eval protocol (4096, 1 per depth; 'correct' = digit-first answer, a dummy):")
    print(train_data.format_summary(train_data.summarize(outcomes)))
    if hasattr(encode, "close"):
        encode.close()
    print(f"{len(fails.items)} failed checks ({time.time() - t0:.0f}s)")
    sys.exit(1 if fails.items else 0)


if __name__ == "__main__":
    main()
