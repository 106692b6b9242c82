"""The training rows of tools/train_tiny/train.py and its quick accuracy's instances, without
torch (only the Python standard library and bench/accuracy's task code), so that
tools/train_tiny/check_data.py can check them on a machine without a GPU.

A row is --row-tokens + 1 token ids packed with documents, each ending in <|endoftext|>, and
a weight per token: 0 padding (never used: rows are filled), 1 text, 2 answer, 3 the first
answer token of an instance (train.py's --first-answer-weight adds a loss term on those).
Documents are natural text (64 corpus lines) or task instances (bench/accuracy/tasks.py) with
the training filler. Every row is a pure function of (seed, phase, row index): its RNGs are
seeded "{seed}[/{phase}]/row/{index}" (and ".../suite" for its suite-sized instance), and
the token counts come from the tokenizer itself.

Instances are fitted with exact token counts (the tokenizer, not a characters-per-token guess):
prompt + answer + <|endoftext|> always fits the room left in the row, so no prompt is cut and
the asked fact is always in the row. An instance that cannot fit (its facts alone exceed the
room) is replaced by text.

Training-only data options (DataOptions; the suite's instances never use them):
  kv_letter_first      share of kv_recall values that start with a letter a-f (the suite's
                       uniform draw gives 6/16; the model learned to answer digit-first
                       values only, since " c435f8" starts with the token "Ġc", not "Ġ");
  vartrack_hard_share  share of vartrack instances with 2-5 distractor-chain facts placed
                       inside the asked chain's span and either depth U[0, 0.3] or 4 hops
                       (half each), the cases the model fails;
  vartrack_distractor_first_share  share of vartrack instances whose distractor chain is in
                       order and opens no later than the asked chain (tasks.py
                       vartrack_distractor_first; only the question's value tells the chains
                       apart), drawn from the instances that are not hard ones;
  suite_share          share of rows that start (position 0, as the suite's prompts do) with
                       one suite-sized instance: length from suite_lengths, prompt fitted as
                       the suite fits it (generate.fit_instance, at most length -
                       max_new_tokens tokens), depth one of the suite's grid +- 0.05, task by
                       the task weights, the training filler, the row's own RNG.
"""
import argparse
import gzip
import math
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "accuracy"))
import generate  # noqa: E402  (the suite's prompt fitting and defaults)
import report  # noqa: E402  (the suite's Wilson interval)
import tasks  # noqa: E402  (the task formats, shared with the suite)

SUITE_DEPTHS = generate.SUITE_DEPTHS
MAX_NEW_TOKENS = generate.MAX_NEW_TOKENS
TASK_WEIGHTS = {"passkey": 0.2, "multikey": 0.3, "kv_recall": 0.25, "vartrack": 0.25}
PAD, TEXT, ANSWER, FIRST_ANSWER = 0, 1, 2, 3
MIN_ROOM = 160          # a task instance starts only where this many tokens are left
LONG_MARGIN = 192       # long instances aim at 2048 .. row_tokens - LONG_MARGIN tokens
SUITE_DEPTH_JITTER = 0.05
SHALLOW_DEPTH = 0.3     # hard vartrack: depth U[0, SHALLOW_DEPTH] (or 4 hops)


def parse_task_weights(text):
    """'passkey=0.1,kv_recall=0.5' -> {task: weight}; every task named must exist."""
    weights = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in TASK_WEIGHTS or not value:
            raise argparse.ArgumentTypeError(f"expected task=weight with task one of "
                                             f"{sorted(TASK_WEIGHTS)}, got {item!r}")
        weights[name] = float(value)
    if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise argparse.ArgumentTypeError("task weights must be non-negative with a positive sum")
    return weights


def _parse_list(text, convert, what, valid, rule):
    """An argparse type: comma-separated values, each converted and all of them valid."""
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
    if not values or not all(valid(v) for v in values):
        raise argparse.ArgumentTypeError(f"{what} must {rule}, got {text!r}")
    return values


def parse_lengths(text):
    return _parse_list(text, int, "token counts", lambda n: n >= 256, "be >= 256 tokens")


def parse_depths(text):
    return _parse_list(text, float, "depths", lambda d: 0 <= d <= 1, "lie in [0, 1]")


def alt_steps_before(step, share):
    """How many of steps 0 .. step-1 take train.py's alternate batch (--alt-share): step s is
    one when floor((s + 1) * share) passes floor(s * share), so they spread evenly (share 0.5:
    every other step, starting with step 1). A run resumed at `step` continues the main stream
    at batch step - alt_steps_before(step) and the alternate one at alt_steps_before(step)."""
    return math.floor(step * share + 1e-9)


def is_alt_step(step, share):
    """Whether step `step` takes the alternate batch (the schedule of alt_steps_before)."""
    return alt_steps_before(step + 1, share) > alt_steps_before(step, share)


def read_lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def read_words(path):
    with open(path, encoding="utf-8") as f:
        return [w for w in f.read().split() if w]


class CachedCounter:
    """Exact token counts len(encode(text)); short texts (filler sentences, facts) repeat, so
    their counts are cached."""

    def __init__(self, encode, cache_below=2000):
        self.encode, self.cache_below, self.cache = encode, cache_below, {}

    def __call__(self, text):
        count = self.cache.get(text)
        if count is None:
            count = len(self.encode(text))
            if len(text) < self.cache_below:
                self.cache[text] = count
        return count


class DataOptions:
    """What a row is made of (train.py builds it from its flags)."""

    def __init__(self, seed, phase="", row_tokens=16384, task_share=0.8, short_share=0.5,
                 task_weights=None, kv_letter_first=None, vartrack_hard_share=0.0,
                 vartrack_distractor_first_share=0.0,
                 suite_share=0.0, suite_lengths=(4096, 8192, 16384),
                 suite_depths=generate.SUITE_DEPTHS, suite_task_weights=None,
                 max_new_tokens=generate.MAX_NEW_TOKENS):
        self.seed, self.phase, self.row_tokens = seed, phase, row_tokens
        self.task_share, self.short_share = task_share, short_share
        self.task_weights = dict(task_weights or TASK_WEIGHTS)
        self.kv_letter_first, self.vartrack_hard_share = kv_letter_first, vartrack_hard_share
        self.vartrack_distractor_first_share = vartrack_distractor_first_share
        self.suite_share, self.suite_depths = suite_share, tuple(suite_depths)
        self.suite_task_weights = dict(suite_task_weights or self.task_weights)
        self.suite_lengths = tuple(length for length in suite_lengths if length <= row_tokens)
        self.max_new_tokens = max_new_tokens
        if suite_share > 0 and not self.suite_lengths:
            raise ValueError(f"no suite length in {tuple(suite_lengths)} fits {row_tokens}-token "
                             f"rows")
        # Phase 1 rows are seeded "{seed}/row/{r}"; later phases add their name.
        self.row_prefix = f"{seed}/{phase}/row" if phase else f"{seed}/row"

    def as_dict(self):
        return {"kv_letter_first": self.kv_letter_first,
                "vartrack_hard_share": self.vartrack_hard_share,
                "vartrack_distractor_first_share": self.vartrack_distractor_first_share,
                "suite_share": self.suite_share, "suite_lengths": list(self.suite_lengths),
                "suite_depths": list(self.suite_depths),
                "suite_task_weights": self.suite_task_weights,
                "max_new_tokens": self.max_new_tokens}


class RowMaker:
    """make_row(index) -> (ids, weights), each row_tokens + 1 long. encode(text) -> token ids
    (the model's tokenizer, no special tokens added), eos: the <|endoftext|> id."""

    def __init__(self, encode, eos, lines, words, options):
        self.encode, self.eos, self.lines, self.words = encode, eos, lines, words
        self.options = options
        self.filler = tasks.FillerText(lines)
        self.count = CachedCounter(encode)

    def _choose_task(self, rng, weights=None):
        weights = weights or self.options.task_weights
        return rng.choices(list(weights), weights=list(weights.values()))[0]

    def _task_options(self, task, rng):
        """The training-only make_instance options of one instance, and a depth override."""
        kw, depth = {}, None
        if task == "kv_recall" and self.options.kv_letter_first is not None:
            kw["kv_letter_first"] = self.options.kv_letter_first
        if task == "vartrack" and self.options.vartrack_hard_share > 0 and \
                rng.random() < self.options.vartrack_hard_share:
            kw["vartrack_span_distractors"] = rng.randint(2, 5)  # at most hops + 1 are used
            if rng.random() < 0.5:
                depth = rng.uniform(0.0, SHALLOW_DEPTH)
            else:
                kw["vartrack_hops"] = 4
        elif task == "vartrack" and self.options.vartrack_distractor_first_share > 0 and \
                rng.random() < self.options.vartrack_distractor_first_share:
            kw["vartrack_distractor_first"] = True  # of the instances that are not hard
        return kw, depth

    def _append(self, ids, weights, prompt, answer):
        ids += prompt + answer + [self.eos]
        weights += [TEXT] * len(prompt) + [FIRST_ANSWER] + [ANSWER] * (len(answer) - 1) + [TEXT]

    def _suite_instance(self, rng, row_index, room, ids, weights, docs):
        """The row's suite-sized instance at position 0 (see the module's docstring)."""
        o = self.options
        length = rng.choice(o.suite_lengths)
        task = self._choose_task(rng, o.suite_task_weights)
        grid = rng.choice(o.suite_depths)
        depth = min(1.0, max(0.0, grid + rng.uniform(-SUITE_DEPTH_JITTER, SUITE_DEPTH_JITTER)))
        kw = {"kv_letter_first": o.kv_letter_first} \
            if task == "kv_recall" and o.kv_letter_first is not None else {}
        seed = f"{o.row_prefix}/{row_index}/suite-instance"
        budget = length - o.max_new_tokens

        def make(target):
            return tasks.make_instance(task, random.Random(seed), self.filler, self.words, target,
                                       depth, self.count, **kw)
        # The training corpus has longer sentences than the suite's filler; fit_instance's
        # doubling steps get past one that keeps overshooting.
        inst = generate.fit_instance(make, budget, self.count)
        if inst is None:
            return
        prompt = self.encode(inst["prompt"])
        answer = self.encode(" " + inst["answer"] + ".")
        if len(prompt) + len(answer) + 1 > room:
            return
        if docs is not None:
            docs.append({"kind": "suite", "start": len(ids), "length": length, "budget": budget,
                         "grid_depth": grid, "prompt_ids": len(prompt),
                         "answer_ids": len(answer), **inst})
        self._append(ids, weights, prompt, answer)

    def _instance(self, rng, room, ids, weights, docs):
        """A task instance fitted exactly into `room` tokens; False when it cannot fit."""
        o = self.options
        task = self._choose_task(rng)
        if rng.random() < o.short_share:
            target = int(math.exp(rng.uniform(math.log(128), math.log(2048))))
        else:
            target = rng.randint(2048, o.row_tokens - LONG_MARGIN)
        depth = rng.random()
        kw, depth_override = self._task_options(task, rng)
        if depth_override is not None:
            depth = depth_override
        target = min(target, room - 1 - o.max_new_tokens - generate.FIRST_TRY_SLACK)
        state = rng.getstate()
        for attempt in range(generate.MAX_TRIES):
            rng.setstate(state)  # the same facts on every try: only the filler shrinks
            inst = tasks.make_instance(task, rng, self.filler, self.words, max(0, target), depth,
                                       self.count, **kw)
            prompt = self.encode(inst["prompt"])
            answer = self.encode(" " + inst["answer"] + ".")
            over = len(prompt) + len(answer) + 1 - room
            if over <= 0:
                if docs is not None:
                    docs.append({"kind": "task", "start": len(ids), "room": room,
                                 "prompt_ids": len(prompt), "answer_ids": len(answer),
                                 "options": kw, **inst})
                self._append(ids, weights, prompt, answer)
                return True
            if target <= 0:
                break  # the facts and the question alone do not fit
            target -= (over + 8) << attempt  # growing steps: a long last sentence gives way
        if docs is not None:
            docs.append({"kind": "unfitted", "start": len(ids), "room": room, "task": task})
        return False

    def _text(self, rng, room, ids, weights, docs):
        start = rng.randrange(len(self.lines))
        doc = self.encode(" ".join(self.lines[start:start + 64]))[:room - 1] + [self.eos]
        if docs is not None:
            docs.append({"kind": "text", "start": len(ids), "ids": len(doc)})
        ids += doc
        weights += [TEXT] * len(doc)

    def make_row(self, row_index, docs=None):
        """The row's (ids, weights); docs, when a list, receives one dict per document."""
        o = self.options
        need = o.row_tokens + 1
        ids, weights = [], []
        if o.suite_share > 0:
            suite_rng = random.Random(f"{o.row_prefix}/{row_index}/suite")
            if suite_rng.random() < o.suite_share:
                self._suite_instance(suite_rng, row_index, need, ids, weights, docs)
        rng = random.Random(f"{o.row_prefix}/{row_index}")
        while len(ids) < need:
            room = need - len(ids)
            if room >= MIN_ROOM and rng.random() < o.task_share and \
                    self._instance(rng, room, ids, weights, docs):
                continue
            self._text(rng, room, ids, weights, docs)
        return ids[:need], weights[:need]


# The quick accuracy at the end of training: the suite's protocol (bench/accuracy/generate.py).

def eval_instances(task, length, seed, depths, per_depth, filler, words, count_tokens,
                   max_new_tokens=generate.MAX_NEW_TOKENS):
    """The suite's instances of one task x length cell: per depth, indices 0..per_depth-1,
    prompts fitted to at most length - max_new_tokens tokens (with seed 0, the suite's
    defaults and the same tokenizer, exactly the instances `bench/accuracy/run` scores)."""
    budget = length - max_new_tokens
    return [generate.fitted_instance(task, seed, length, depth, index, budget, filler, words,
                                     count_tokens)
            for depth in depths for index in range(per_depth)]


def stop_token_ids(decode_one, vocab_size):
    """Ids whose text holds '.' or a newline: scoring (tasks.score) reads the continuation only
    up to the first of those, so greedy decoding may stop at such a token."""
    return [i for i in range(vocab_size) if any(c in decode_one(i) for c in ".\n")]


def summarize(outcomes):
    """outcomes: [(task, length, depth, correct)] -> {"task@length": {correct, n, accuracy,
    ci95_low, ci95_high, by_depth}} with the suite's Wilson interval (report.py)."""
    cells = {}
    for task, length, depth, correct in outcomes:
        cell = cells.setdefault(f"{task}@{length}", {"correct": 0, "n": 0, "by_depth": {}})
        cell["correct"] += int(correct)
        cell["n"] += 1
        by_depth = cell["by_depth"].setdefault(f"{depth:g}", [0, 0])
        by_depth[0] += int(correct)
        by_depth[1] += 1
    for cell in cells.values():
        low, high = report.wilson_interval(cell["correct"], cell["n"])
        cell.update(accuracy=round(cell["correct"] / cell["n"], 4), ci95_low=round(low, 4),
                    ci95_high=round(high, 4))
    return cells


def format_summary(cells):
    lines = [f"{'task':<10} {'length':>6} {'acc':>6} {'95% interval':>14} {'n':>4}  by depth"]
    for key, cell in cells.items():
        task, length = key.split("@")
        depths = " ".join(f"{d}:{c}/{n}" for d, (c, n) in cell["by_depth"].items())
        lines.append(f"{task:<10} {length:>6} {cell['accuracy']:>6.2f} "
                     f"{'[%.2f, %.2f]' % (cell['ci95_low'], cell['ci95_high']):>14} "
                     f"{cell['n']:>4}  {depths}")
    return "\n".join(lines)
