#!/usr/bin/env python3
"""Trains rubato's small Qwen3-architecture decoders that really depend on long-range attention,
for the accuracy suite (bench/accuracy): the bundled tiny model (--shape tiny, the embedded
default) and the deeper yardstick (--shape yardstick). SHAPES below lists both.

Data (train_data.py, which needs no torch: a pure function of --seed, --phase and the row
index, so a resumed run sees exactly the rows a single run would have seen):
  * natural text: .cache/corpus/train.txt(.gz) from tools/train_tiny/extract_corpus.sh
    (Debian's bible-kjv and fortunes; the accuracy suite's filler is held out);
  * synthetic long-context instances from bench/accuracy/tasks.py (passkey, multi-key needle
    with distractors, key-value recall, variable tracking) with that natural-text filler,
    target lengths 128 to (row length - 192) tokens and depths uniform in [0, 1], fitted into
    the row with exact token counts; optionally (--suite-share) a suite-sized instance at the
    start of a row, letter-first kv_recall values (--kv-letter-first) and vartrack chains with
    distractors inside (--vartrack-hard-share).
Each training row is --row-tokens (+1) tokens (default: the shape's context) packed with
documents, each ending in <|endoftext|>. tools/train_tiny/check_data.py checks the rows.
With --alt-share a share of the steps take a batch of another shape and mix instead
(--alt-row-tokens, --alt-batch-size, --alt-short-share, --alt-task-weights, --alt-suite-share;
rows seeded by the phase + "-alt"): e.g. short rows dense with kv_recall instances, which teach
the first value token, interleaved with full-context rows, which keep the long retrieval.
Loss: mean cross-entropy over all tokens plus the mean over answer tokens (weight
--answer-weight), so that the few answer tokens of a long instance still teach retrieval, plus
the mean over each instance's first answer token (weight --first-answer-weight).

Model: Qwen3ForCausalLM (transformers) of the chosen shape, tied embeddings, vocab 4096
(byte-level BPE trained here with `tokenizers`, or taken from --tokenizer-from),
rope_theta 100000. bf16 autocast, fp32 master weights, AdamW.

Time budget: with --on-timeout checkpoint (the default) a call that reaches --time-budget-s
writes a checkpoint (model fp32, AdamW moments bf16, step) split into <= 15 MB parts under
--out; pass that folder back as --resume on the next call. With --on-timeout export it exports
the weights reached instead (the cosine schedule then runs on elapsed time as well as steps,
--schedule-by-time, so the rate has decayed when the budget ends). When done it exports the
Hugging Face checkpoint
(config.json, model.safetensors bf16, tokenizer.json, tokenizer_config.json) to --out/model/
and runs a quick GPU accuracy check on the suite's protocol (the suite's fitted instances, 5
depths x --eval-instances per task x length, Wilson intervals). Run it through
scripts/gpu/train_tiny.sh.
"""
import argparse
import io
import json
import math
import os
import random
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_data  # noqa: E402  (the rows; also puts bench/accuracy on the path)
from train_data import tasks  # noqa: E402

SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
         r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Model shapes. eval_lengths are the suite's lengths for the model (the quick accuracy check's
# and the suite-sized training instances' lengths).
SHAPES = {
    "tiny": dict(hidden=256, mlp=768, layers=6, heads=8, kv_heads=2, head_dim=32,
                 context=8192, eval_lengths=(2048, 4096, 8192)),
    "yardstick": dict(hidden=256, mlp=512, layers=12, heads=8, kv_heads=4, head_dim=64,
                      context=16384, eval_lengths=(4096, 8192, 16384)),
}
CHARS_PER_TOKEN_GUESS = 3.5  # only sizes the tokenizer's training samples


def train_tokenizer(lines, words, vocab_size, seed):
    filler = tasks.FillerText(lines)
    rng = random.Random(f"{seed}/tokenizer")
    counter = tasks.chars_counter(CHARS_PER_TOKEN_GUESS)
    samples = [tasks.make_instance(t, rng, filler, words, 256, rng.random(), counter)["prompt"]
               for t in tasks.TASKS for _ in range(500)]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines + samples, trainer)
    return tok


def data_options(args):
    return train_data.DataOptions(
        seed=args.seed, phase=args.phase, row_tokens=args.row_tokens,
        task_share=args.task_share, short_share=args.short_share, task_weights=args.task_weights,
        kv_letter_first=args.kv_letter_first, vartrack_hard_share=args.vartrack_hard_share,
        vartrack_distractor_first_share=args.vartrack_distractor_first_share,
        suite_share=args.suite_share, suite_lengths=args.suite_lengths,
        suite_depths=args.suite_depths, suite_task_weights=args.suite_task_weights)


def alt_args(args):
    """The alternate batches' flags: the main ones with the --alt-* values in place."""
    alt = argparse.Namespace(**vars(args))
    alt.phase = f"{args.phase}-alt"
    alt.row_tokens, alt.batch_size = args.alt_row_tokens, args.alt_batch_size
    if args.alt_short_share is not None:
        alt.short_share = args.alt_short_share
    if args.alt_task_weights is not None:
        alt.task_weights = args.alt_task_weights
    if args.alt_suite_share is not None:
        alt.suite_share = args.alt_suite_share
    alt.suite_lengths = [n for n in args.suite_lengths if n <= alt.row_tokens] or \
        [alt.row_tokens]
    alt.suite_depths, alt.suite_task_weights = train_data.SUITE_DEPTHS, None  # main rows only
    return alt


def alt_summary(args):
    alt = alt_args(args)
    return {"row_tokens": alt.row_tokens, "batch_size": alt.batch_size,
            "short_share": alt.short_share, "task_weights": alt.task_weights,
            "data": data_options(alt).as_dict()}


def batches(args, tokenizer_json, lines, words, step):
    """(is_alt, tokens, weights) for steps step, step + 1, ...: main and alternate batches from
    two loaders (workers split by share), each resuming at its own batch index."""
    share = args.alt_share
    n_alt = train_data.alt_steps_before(step, share)
    alt_workers = max(1, round(args.workers * share)) if share else 0
    main_workers = max(1, args.workers - alt_workers)

    def loader(a, start, workers):
        stream = RowStream(tokenizer_json, lines, words, a, start)
        return iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers,
                                                prefetch_factor=4, persistent_workers=False))

    main = loader(args, step - n_alt, main_workers)
    alt = loader(alt_args(args), n_alt, alt_workers) if share else None
    while True:
        is_alt = train_data.is_alt_step(step, share)
        tokens, weights = next(alt if is_alt else main)
        yield is_alt, tokens, weights
        step += 1


class RowStream(torch.utils.data.IterableDataset):
    """Yields (tokens [B][ROW+1] int64, weights [B][ROW+1] uint8) for batches start, start+1, ...
    Weights (train_data): 0 padding (never used: rows are filled), 1 text, 2 answer token,
    3 an instance's first answer token."""

    def __init__(self, tokenizer_json, lines, words, args, start_batch):
        self.tokenizer_json, self.lines, self.words = tokenizer_json, lines, words
        self.batch_size, self.start_batch = args.batch_size, start_batch
        self.options = data_options(args)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        tok = Tokenizer.from_str(self.tokenizer_json)
        maker = train_data.RowMaker(lambda text: tok.encode(text).ids,
                                    tok.token_to_id("<|endoftext|>"), self.lines, self.words,
                                    self.options)
        b = self.start_batch + worker
        while True:
            rows = [maker.make_row(b * self.batch_size + i) for i in range(self.batch_size)]
            yield (torch.tensor([r[0] for r in rows], dtype=torch.int64),
                   torch.tensor([r[1] for r in rows], dtype=torch.uint8))
            b += workers


def model_config(shape, vocab_size, eos_id):
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], hidden_act="silu",
        max_position_embeddings=shape["context"], rms_norm_eps=1e-6, rope_theta=100000.0,
        tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)


def lr_at(step, total, peak, warmup, time_progress=0.0):
    """Linear warmup, then cosine to 10 % of peak; progress is the step's share of the run,
    or the share of the time budget used when that is larger (--schedule-by-time)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_progress))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(out_dir, model, optimizer, step, tokenizer_json):
    """model fp32 + AdamW moments bf16 + step, split into <= 15 MB files ckpt.partN."""
    state = {"step": step, "model": model.state_dict(), "tokenizer": tokenizer_json,
             "optimizer": {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}}
    for k, v in optimizer.state_dict()["state"].items():
        state["optimizer"]["state"][k] = {
            name: (t.to(torch.bfloat16) if torch.is_tensor(t) and t.dim() > 0 else t)
            for name, t in v.items()}
    buf = io.BytesIO()
    torch.save(state, buf)
    data, part = buf.getvalue(), 15 * 1024 * 1024
    for old in os.listdir(out_dir):
        if old.startswith("ckpt.part"):
            os.remove(os.path.join(out_dir, old))
    for i in range(0, len(data), part):
        with open(os.path.join(out_dir, f"ckpt.part{i // part}"), "wb") as f:
            f.write(data[i:i + part])
    print(f"checkpoint at step {step}: {len(data) / 1e6:.1f} MB in "
          f"{math.ceil(len(data) / part)} parts", flush=True)


def load_checkpoint(resume_dir):
    parts = sorted((p for p in os.listdir(resume_dir) if p.startswith("ckpt.part")),
                   key=lambda p: int(p[len("ckpt.part"):]))
    data = b"".join(open(os.path.join(resume_dir, p), "rb").read() for p in parts)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def export(model, tok, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config.to_dict()
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
        "hidden_act": "silu", "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": 100000.0, "rope_scaling": None,
        "max_position_embeddings": cfg["max_position_embeddings"],
        "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": cfg["num_hidden_layers"],
        "torch_dtype": "bfloat16", "bos_token_id": None,
        "eos_token_id": tok.token_to_id("<|endoftext|>"), "use_cache": True,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    weights = {k: v.detach().to(torch.bfloat16).contiguous().cpu()
               for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                   "model_max_length": cfg["max_position_embeddings"], "bos_token": None,
                   "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False},
                  f, indent=2)


@torch.no_grad()
def quick_accuracy(model, tok, filler_path, words, seed, lengths, per_depth):
    """Greedy exact match on the suite's protocol (train_data.eval_instances: held-out filler,
    prompts fitted to length - max_new_tokens tokens, the suite's 5 depths x per_depth
    instances per task x length; seed 0 gives the suite's own instances), GPU, bf16. Decoding
    stops at a token holding '.' or a newline (where tasks.score stops reading) or after the
    suite's max_new_tokens. Returns train_data.summarize's cells."""
    filler = tasks.FillerText.from_file(filler_path)
    count = train_data.CachedCounter(lambda text: tok.encode(text).ids)
    eos = tok.token_to_id("<|endoftext|>")
    stop = [eos] + [i for i in train_data.stop_token_ids(lambda i: tok.decode([i]),
                                                         tok.get_vocab_size()) if i != eos]
    outcomes = []
    model.eval()
    for task in tasks.TASKS:
        for length in lengths:
            for inst in train_data.eval_instances(task, length, seed, train_data.SUITE_DEPTHS,
                                                  per_depth, filler, words, count):
                ids = torch.tensor([tok.encode(inst["prompt"]).ids], device="cuda")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model.generate(ids, max_new_tokens=train_data.MAX_NEW_TOKENS,
                                         do_sample=False, eos_token_id=stop, pad_token_id=eos)
                text = tok.decode(out[0, ids.shape[1]:].tolist())
                outcomes.append((task, length, inst["depth"], tasks.score(text, inst["answer"])))
    model.train()
    return train_data.summarize(outcomes)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=".cache/corpus/train.txt.gz")
    p.add_argument("--words", default="bench/accuracy/data/words.txt")
    p.add_argument("--eval-filler", default="bench/accuracy/data/filler.txt")
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--row-tokens", type=int, default=0,
                   help="tokens per training row (default: the shape's context)")
    p.add_argument("--tokenizer-from", default=None,
                   help="take tokenizer.json from this model folder instead of training one")
    p.add_argument("--on-timeout", choices=("checkpoint", "export"), default="checkpoint")
    p.add_argument("--schedule-by-time", action="store_true",
                   help="decay the learning rate on the time budget as well as the steps")
    p.add_argument("--compile", action="store_true",
                   help="train through torch.compile (falls back to eager if compiling fails)")
    p.add_argument("--resume", default=None, help="folder holding ckpt.part* of a previous call")
    p.add_argument("--seed", type=int, default=20261121)
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--answer-weight", type=float, default=1.0)
    p.add_argument("--first-answer-weight", type=float, default=0.0,
                   help="weight of an added loss term: the mean cross-entropy of each "
                        "instance's first answer token")
    p.add_argument("--kv-letter-first", type=float, default=None,
                   help="share of kv_recall values starting with a letter a-f (default: the "
                        "suite's uniform hex, 6/16)")
    p.add_argument("--vartrack-hard-share", type=float, default=0.0,
                   help="share of vartrack instances with 2-5 distractor facts inside the "
                        "asked chain and depth <= 0.3 or 4 hops")
    p.add_argument("--vartrack-distractor-first-share", type=float, default=0.0,
                   help="share of the other vartrack instances whose distractor chain is in "
                        "order and opens no later than the asked chain")
    p.add_argument("--suite-share", type=float, default=0.0,
                   help="share of rows starting with one suite-sized instance (fitted as the "
                        "suite fits it, the suite's depth grid +- 0.05)")
    p.add_argument("--suite-lengths", type=train_data.parse_lengths, default=None,
                   help="lengths of the suite-sized instances, drawn uniformly (repeat one to "
                        "weight it; default: the shape's suite lengths that fit --row-tokens)")
    p.add_argument("--suite-depths", type=train_data.parse_depths,
                   default=list(train_data.SUITE_DEPTHS),
                   help="grid depths of the suite-sized instances of the main rows, drawn "
                        "uniformly (repeat one to weight it; default: the suite's grid)")
    p.add_argument("--suite-task-weights", type=train_data.parse_task_weights, default=None,
                   help="task weights of the main rows' suite-sized instances (default: "
                        "--task-weights)")
    p.add_argument("--eval-seed", type=int, default=0,
                   help="seed of the quick accuracy's instances (0: the suite's own)")
    p.add_argument("--eval-instances", type=int, default=5,
                   help="quick accuracy instances per depth (5 depths) per task x length")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--time-budget-s", type=float, default=480)
    p.add_argument("--task-share", type=float, default=0.8,
                   help="probability that the next document of a row is a task instance")
    p.add_argument("--task-weights", type=train_data.parse_task_weights,
                   default=dict(train_data.TASK_WEIGHTS),
                   help="task=weight list of the task mix, e.g. kv_recall=0.4,vartrack=0.4")
    p.add_argument("--short-share", type=float, default=0.5,
                   help="share of instances with 128-2048 tokens (the rest 2048-8000)")
    p.add_argument("--phase", default="", help="names a later training phase (seeds its rows)")
    p.add_argument("--init-from", default=None,
                   help="start from an exported model folder (weights + tokenizer), fresh AdamW")
    p.add_argument("--alt-share", type=float, default=0.0,
                   help="share of steps that take an alternate batch (the --alt-* flags)")
    p.add_argument("--alt-row-tokens", type=int, default=4096)
    p.add_argument("--alt-batch-size", type=int, default=32)
    p.add_argument("--alt-short-share", type=float, default=None)
    p.add_argument("--alt-task-weights", type=train_data.parse_task_weights, default=None)
    p.add_argument("--alt-suite-share", type=float, default=None)
    args = p.parse_args()
    shape = SHAPES[args.shape]
    args.row_tokens = args.row_tokens or shape["context"]
    if args.suite_lengths is None:
        args.suite_lengths = [n for n in shape["eval_lengths"] if n <= args.row_tokens]
    for name in ("kv_letter_first", "vartrack_hard_share", "vartrack_distractor_first_share",
                 "suite_share", "alt_share",
                 "alt_short_share", "alt_suite_share"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 1:
            p.error(f"--{name.replace('_', '-')} {value} outside [0, 1]")
    if args.suite_share and not [n for n in args.suite_lengths if n <= args.row_tokens]:
        p.error(f"no --suite-lengths fit --row-tokens {args.row_tokens}")
    for flag, tokens in (("--row-tokens", args.row_tokens),
                         ("--alt-row-tokens", args.alt_row_tokens)):
        if not 2048 + 192 <= tokens <= shape["context"]:
            p.error(f"{flag} {tokens} outside [2240, {shape['context']}]")
    if args.alt_batch_size < 1:
        p.error(f"--alt-batch-size {args.alt_batch_size} must be >= 1")
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    lines = train_data.read_lines(args.corpus)
    words = train_data.read_words(args.words)

    state = load_checkpoint(args.resume) if args.resume else None
    if state:
        tok = Tokenizer.from_str(state["tokenizer"])
    elif args.init_from or args.tokenizer_from:
        tok = Tokenizer.from_file(os.path.join(args.init_from or args.tokenizer_from,
                                               "tokenizer.json"))
    else:
        tok = train_tokenizer(lines, words, args.vocab, args.seed)
    tokenizer_json = tok.to_str()
    print(f"corpus {len(lines)} lines; tokenizer {tok.get_vocab_size()} tokens "
          f"({time.time() - t0:.0f}s)", flush=True)

    model = Qwen3ForCausalLM(model_config(shape, args.vocab, tok.token_to_id("<|endoftext|>")))
    model.config._attn_implementation = "sdpa"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, eps=1e-8)
    step = 0
    if state:
        model.load_state_dict(state["model"])
        step = state["step"]
    elif args.init_from:
        weights = load_file(os.path.join(args.init_from, "model.safetensors"))
        missing, unexpected = model.load_state_dict(
            {k: v.float() for k, v in weights.items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    model.cuda().train()
    if state:
        opt_state = state["optimizer"]
        for v in opt_state["state"].values():
            for name, t in v.items():
                if torch.is_tensor(t) and t.dim() > 0:
                    v[name] = t.float()
        optimizer.load_state_dict(opt_state)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:.2f} M parameters; starting at step {step}/{args.steps}",
          flush=True)

    # The training forward: compiled when asked (fixed row shapes: one compilation); export,
    # checkpoints and the accuracy check use `model` itself.
    forward = model
    if args.compile:
        forward = torch.compile(model)
    tokens_seen, t_train = 0, time.time()
    for is_alt, batch, weights in batches(args, tokenizer_json, lines, words, step):
        elapsed = time.time() - t0
        if step >= args.steps or elapsed > args.time_budget_s:
            break
        batch, weights = batch.cuda(non_blocking=True), weights.cuda(non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup,
                                elapsed / args.time_budget_s if args.schedule_by_time else 0.0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            try:
                logits = forward(input_ids=batch[:, :-1]).logits
            except Exception as error:  # noqa: BLE001 - a compiler failure: train eagerly
                if forward is model:
                    raise
                print(f"torch.compile failed ({type(error).__name__}: {error}); training eagerly",
                      flush=True)
                forward = model
                logits = forward(input_ids=batch[:, :-1]).logits
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                             batch[:, 1:].reshape(-1), reduction="none")
        w = weights[:, 1:].reshape(-1)
        lm_loss = ce[w > 0].mean()
        answer = w >= train_data.ANSWER
        zero = torch.zeros((), device=ce.device)
        answer_loss = ce[answer].mean() if answer.any() else zero
        loss = lm_loss + args.answer_weight * answer_loss
        first = w == train_data.FIRST_ANSWER
        first_loss = ce[first].mean() if first.any() else zero
        if args.first_answer_weight:
            loss = loss + args.first_answer_weight * first_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += batch.shape[0] * (batch.shape[1] - 1)
        if step % 25 == 0 or step == 1:
            rate = tokens_seen / (time.time() - t_train)
            kind = " alt" if is_alt else ""
            print(f"step {step}{kind} lm {lm_loss.item():.3f} answer {answer_loss.item():.3f} "
                  f"first {first_loss.item():.3f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} {rate / 1e3:.0f}k tok/s "
                  f"t={time.time() - t0:.0f}s", flush=True)

    if step < args.steps and args.on_timeout == "checkpoint":
        save_checkpoint(args.out, model, optimizer, step, tokenizer_json)
        print(f"RESUME: {step}/{args.steps} steps done", flush=True)
        return
    if step < args.steps:
        print(f"time budget reached at step {step}/{args.steps}: exporting", flush=True)
    export(model, tok, os.path.join(args.out, "model"))
    t_eval = time.time()
    acc = quick_accuracy(model, tok, args.eval_filler, words, args.eval_seed,
                         shape["eval_lengths"], args.eval_instances)
    n_cell = len(train_data.SUITE_DEPTHS) * args.eval_instances
    print(f"quick accuracy (bf16, GPU, suite protocol, seed {args.eval_seed}, {n_cell} per cell, "
          f"{time.time() - t_eval:.0f}s):\n{train_data.format_summary(acc)}", flush=True)
    print("quick accuracy:", json.dumps({k: v["accuracy"] for k, v in acc.items()}), flush=True)
    with open(os.path.join(args.out, "model", "training_log.json"), "w") as f:
        json.dump({"shape": args.shape, "steps": step, "planned_steps": args.steps,
                   "seed": args.seed, "batch_size": args.batch_size,
                   "row_tokens": args.row_tokens, "lr": args.lr, "answer_weight": args.answer_weight,
                   "first_answer_weight": args.first_answer_weight,
                   "data": data_options(args).as_dict(), "eval_seed": args.eval_seed,
                   "phase": args.phase, "init_from": args.init_from,
                   "task_share": args.task_share, "short_share": args.short_share,
                   "task_weights": args.task_weights,
                   "alt_share": args.alt_share,
                   "alt": alt_summary(args) if args.alt_share else None,
                   "parameters": n_params, "quick_accuracy": acc,
                   "torch": torch.__version__}, f, indent=1)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
