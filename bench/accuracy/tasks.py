"""Synthetic long-context tasks (RULER-style), shared by the accuracy suite and the training of
the bundled tiny model, so that both see exactly the same formats.

Tasks (each instance is natural-text filler with facts hidden in it, then a question whose
answer is a short string the model must copy from the context):
  passkey    one needle "The pass key is 48213. Remember it. 48213 is the pass key." at the
             given depth; answer: the number.
  multikey   several "One of the special magic numbers for <word> is: <number>." needles with
             distinct keys (the others are distractors); the asked one sits at the given depth.
  kv_recall  8-24 "The value of key <hex> is <hex>." facts spread through the text; the asked
             one sits at the given depth; answer: the value.
  vartrack   a chain of assignments "VAR ABCDE = 41297." then "VAR FGHIJ = VAR ABCDE." ...,
             plus a distractor chain with another value; the chain starts at the given depth;
             answer: the chain's variable names in order of appearance.

Depth d in [0, 1] places the asked fact after a fraction d of the filler sentences (0 = the
start of the context, 1 = just before the question). Lengths are in tokens: the caller passes
a token counter (exact with a tokenizer, or characters / chars_per_token when none is at
hand) and the filler is sized so that the whole prompt comes close to the target.

Scoring is exact match: the generated continuation up to the first '.' or newline, stripped,
must equal the answer (see `score`). Only the Python standard library is used.

Training-only options of make_instance (tools/train_tiny/train_data.py; the suite never passes
them, and with them left at their defaults the RNG draws, hence every suite instance, are
exactly those of the original generator): kv_letter_first (share of kv_recall values whose
first character is a letter a-f instead of the uniform 6/16), vartrack_hops (a fixed chain
length instead of 2-4), vartrack_span_distractors (that many distractor-chain facts placed
between the asked chain's first and last facts) and vartrack_distractor_first (the distractor
chain in order too, opening no later than the asked chain: only the question's value tells the
chains apart).
"""
import random
import re

TASKS = ("passkey", "multikey", "kv_recall", "vartrack")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class FillerText:
    """Natural-text sentences (one paragraph per input line, split at sentence ends)."""

    def __init__(self, lines):
        self.sentences = []
        for line in lines:
            for sentence in SENTENCE_END.split(line.strip()):
                if sentence:
                    self.sentences.append(sentence)
        if not self.sentences:
            raise ValueError("filler text has no sentences")

    @classmethod
    def from_file(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls(f.readlines())

    def run(self, rng, token_budget, count_tokens):
        """Consecutive sentences from a random start whose token counts add up to about
        token_budget (wrapping around the corpus)."""
        out, used = [], 0
        i = rng.randrange(len(self.sentences))
        while used < token_budget:
            sentence = self.sentences[i % len(self.sentences)]
            used += count_tokens(" " + sentence)
            out.append(sentence)
            i += 1
        return out


def _number(rng, digits_min, digits_max):
    digits = rng.randint(digits_min, digits_max)
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def _hex(rng, n=6, letter_first=None):
    """n random hex digits; with letter_first (training only) the first one is a letter a-f
    with that probability and a digit otherwise."""
    if letter_first is None:
        return "".join(rng.choice("0123456789abcdef") for _ in range(n))
    first = rng.choice("abcdef") if rng.random() < letter_first else rng.choice("0123456789")
    return first + "".join(rng.choice("0123456789abcdef") for _ in range(n - 1))


def _var_name(rng):
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _facts(task, rng, words, kv_letter_first=None, vartrack_hops=None):
    """(facts, asked_index, question, answer): facts are sentences to hide in the filler;
    facts[asked_index] is the one the question is about (placed at the instance's depth)."""
    if task == "passkey":
        key = _number(rng, 5, 7)
        fact = f"The pass key is {key}. Remember it. {key} is the pass key."
        return [fact], 0, "What is the pass key? The pass key is", key
    if task == "multikey":
        keys = rng.sample(words, rng.randint(3, 6))
        values = [_number(rng, 6, 7) for _ in keys]
        facts = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        asked = rng.randrange(len(keys))
        question = (f"What is the special magic number for {keys[asked]} mentioned in the "
                    f"provided text? The special magic number for {keys[asked]} mentioned in "
                    f"the provided text is")
        return facts, asked, question, values[asked]
    if task == "kv_recall":
        n = rng.randint(8, 24)
        keys = [_hex(rng) for _ in range(n)]
        values = [_hex(rng, letter_first=kv_letter_first) for _ in range(n)]
        facts = [f"The value of key {k} is {v}." for k, v in zip(keys, values)]
        asked = rng.randrange(n)
        return facts, asked, f"What is the value of key {keys[asked]}? The value of key " \
                             f"{keys[asked]} is", values[asked]
    if task == "vartrack":
        hops = rng.randint(2, 4) if vartrack_hops is None else vartrack_hops
        names = []
        while len(names) < 2 * (hops + 1):
            name = _var_name(rng)
            if name not in names:
                names.append(name)
        chain, other = names[:hops + 1], names[hops + 1:]
        value, other_value = _number(rng, 5, 5), _number(rng, 5, 5)
        facts = [f"VAR {chain[0]} = {value}."]
        facts += [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, hops + 1)]
        facts += [f"VAR {other[0]} = {other_value}."]
        facts += [f"VAR {other[i]} = VAR {other[i - 1]}." for i in range(1, hops + 1)]
        question = (f"Question: Which variables are assigned the value {value}? Answer: The "
                    f"variables assigned the value {value} are")
        return facts, 0, question, " ".join(chain)
    raise ValueError(f"unknown task '{task}' (known: {', '.join(TASKS)})")


def make_instance(task, rng, filler, words, target_tokens, depth, count_tokens, *,
                  kv_letter_first=None, vartrack_hops=None, vartrack_span_distractors=0,
                  vartrack_distractor_first=False):
    """One instance as a dict: prompt (text ending with the question), answer (the string
    to produce), where the asked fact starts in the prompt (asked_char_offset), and for
    vartrack the chain length (hops) and how many distractor-chain facts lie between the asked
    chain's first and last facts (span_distractors). The keyword options are training-only
    (see the module's docstring); their defaults give the suite's instances."""
    facts, asked, question, answer = _facts(task, rng, words, kv_letter_first, vartrack_hops)
    fixed = sum(count_tokens(" " + f) for f in facts) + count_tokens("\n" + question)
    sentences = filler.run(rng, max(0, target_tokens - fixed), count_tokens)
    n = len(sentences)
    # Slot s means "before filler sentence s" (s = n: right before the question).
    slots = [0] * len(facts)
    slots[asked] = round(depth * n)
    extra = {}
    if task == "vartrack":
        # The asked chain starts at the depth and continues in order after it; the distractor
        # chain is spread over the whole text.
        hops = (len(facts) - 2) // 2
        rest = sorted(rng.randint(slots[0], n) for _ in range(hops))
        for i, s in enumerate(rest):
            slots[1 + i] = s
        if vartrack_distractor_first:  # in order, opening no later than the asked chain
            slots[hops + 1] = rng.randint(0, slots[0])
            for i, s in enumerate(sorted(rng.randint(slots[hops + 1], n) for _ in range(hops))):
                slots[hops + 2 + i] = s
        else:
            for i in range(hops + 1, len(facts)):
                slots[i] = rng.randint(0, n)
        # Facts are ordered by (slot, key); a distractor moved inside the asked chain's span
        # goes between chain facts j and j + 1 (key j + 0.5 at a slot between theirs).
        keys = {i: (slots[i], i) for i in range(len(facts))}
        if vartrack_distractor_first:
            keys[hops + 1] = (slots[hops + 1], -1)  # before the asked chain's first fact
        if vartrack_span_distractors:
            inside = rng.sample(range(hops + 1, len(facts)),
                                min(vartrack_span_distractors, hops + 1))
            for i in inside:
                j = rng.randrange(hops)
                slots[i] = rng.randint(slots[j], slots[j + 1])
                keys[i] = (slots[i], j + 0.5)
        order = sorted(range(len(facts)), key=lambda i: keys[i])
        position = {i: p for p, i in enumerate(order)}
        other = [position[i] for i in range(hops + 1, len(facts))]
        extra = {"hops": hops, "span_distractors": sum(
            position[0] < position[i] < position[hops] for i in range(hops + 1, len(facts))),
            "distractor_first": other == sorted(other) and other[0] < position[0]}
    else:
        for i in range(len(facts)):
            if i != asked:
                slots[i] = rng.randint(0, n)
        order = sorted(range(len(facts)), key=lambda i: (slots[i], i != asked, i))
    by_slot = {}
    for i in order:
        by_slot.setdefault(slots[i], []).append(i)
    parts, asked_offset, length = [], 0, 0
    for s in range(n + 1):
        for i in by_slot.get(s, []):
            if i == asked:
                asked_offset = length + (1 if parts else 0)
            parts.append(facts[i])
            length += len(facts[i]) + (1 if len(parts) > 1 else 0)
        if s < n:
            parts.append(sentences[s])
            length += len(sentences[s]) + (1 if len(parts) > 1 else 0)
    prompt = " ".join(parts) + "\n" + question
    return {"task": task, "target_tokens": target_tokens, "depth": depth, "prompt": prompt,
            "answer": answer, "asked_char_offset": asked_offset, "asked_fact": facts[asked],
            **extra}


def chars_counter(chars_per_token):
    """A token counter for when no tokenizer is at hand."""
    return lambda text: max(1, round(len(text) / chars_per_token))


def instance_rng(seed, task, length, depth, index):
    """The RNG of one grid cell's index-th instance: fixed by (seed, task, length, depth,
    index), so asking for more instances keeps the earlier ones."""
    return random.Random(f"rubato-accuracy/{seed}/{task}/{length}/{depth}/{index}")


def score(generated, answer):
    """Exact match of the continuation up to the first '.' or newline."""
    prediction = re.split(r"[.\n]", generated, maxsplit=1)[0].strip()
    return prediction == answer.strip()
