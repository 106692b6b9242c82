#!/usr/bin/env python3
"""Writes small deterministic random Hugging Face checkpoints for rubato's tests and demo.

Each model is a directory that both Hugging Face transformers and rubato load:
config.json, model.safetensors (or shards + model.safetensors.index.json), tokenizer.json (a
byte-level BPE trained with the `tokenizers` library on a fixed corpus) and
tokenizer_config.json (with a chat template rubato recognises).

Models (all GQA group 4, 4 layers):
  tiny-qwen3-random   Qwen3ForCausalLM, bf16, q/k-norm, head_dim 32 != hidden/heads, tied
                      embeddings, rope_theta 50000. The bundled default model (models/).
  tiny-llama3-random  LlamaForCausalLM, f16, two shards + index, untied, rope_theta 500000
                      with `llama3` rope scaling whose thresholds fall inside head_dim 16's
                      frequency range, so all three branches of the scaling are exercised.
  tiny-qwen2-random   Qwen2ForCausalLM, f32, q/k/v bias.

Weights are N(0, 1/fan_in) (embedding rows too) so activations stay O(1) and logits are
well separated; norm weights are 1 + N(0, 0.1). Deterministic for a given seed and torch version.

Needs: torch, safetensors, tokenizers (run it on the GPU machine: scripts/gpu/golden.sh).
Usage: make_tiny_model.py --out DIR [--models tiny-qwen3-random,...] [--seed 1234]
"""
import argparse
import inspect
import json
import math
import os

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")

# The shapes of each model. vocab_size is the tokenizer's size rounded up to 64, as real
# checkpoints pad their embedding tables.
SPECS = {
    "tiny-qwen3-random": dict(
        arch="Qwen3ForCausalLM", model_type="qwen3", dtype="bfloat16", shards=1,
        hidden=128, intermediate=384, layers=4, heads=8, kv_heads=2, head_dim=32,
        rope_theta=50000.0, rope_scaling=None, tie=True, bias=False, max_pos=4096,
        tokenizer_vocab=1000, split=QWEN_SPLIT, nfc=True,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", template=CHATML_TEMPLATE, ignore_merges=False),
    "tiny-llama3-random": dict(
        arch="LlamaForCausalLM", model_type="llama", dtype="float16", shards=2,
        hidden=128, intermediate=320, layers=4, heads=8, kv_heads=2, head_dim=16,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
        tie=False, bias=False, max_pos=2048,
        tokenizer_vocab=1000, split=LLAMA3_SPLIT, nfc=False,
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA3_TEMPLATE, ignore_merges=True),
    "tiny-qwen2-random": dict(
        arch="Qwen2ForCausalLM", model_type="qwen2", dtype="float32", shards=1,
        hidden=96, intermediate=256, layers=4, heads=8, kv_heads=2, head_dim=12,
        rope_theta=10000.0, rope_scaling=None, tie=False, bias=True, max_pos=2048,
        tokenizer_vocab=800, split=QWEN_SPLIT, nfc=True,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", template=CHATML_TEMPLATE, ignore_merges=False),
}


def training_corpus():
    """A fixed English corpus: the docstrings of a fixed list of standard-library modules."""
    import argparse as m1, collections as m2, json as m3, os as m4, re as m5, string as m6
    import textwrap as m7, functools as m8, itertools as m9, random as m10, heapq as m11
    texts = []
    for module in (m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11):
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
    return texts


def train_tokenizer(spec):
    tok = Tokenizer(models.BPE(ignore_merges=spec["ignore_merges"]))
    if spec["nfc"]:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["tokenizer_vocab"], special_tokens=spec["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    if spec["bos"]:
        bos_id = tok.token_to_id(spec["bos"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec['bos']} $A", pair=f"{spec['bos']} $A {spec['bos']} $B",
            special_tokens=[(spec["bos"], bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_config(spec, tok):
    vocab = int(math.ceil(tok.get_vocab_size() / 64) * 64)
    cfg = {
        "architectures": [spec["arch"]], "model_type": spec["model_type"],
        "vocab_size": vocab, "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"], "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": spec["rope_theta"], "rope_scaling": spec["rope_scaling"],
        "max_position_embeddings": spec["max_pos"], "tie_word_embeddings": spec["tie"],
        "torch_dtype": spec["dtype"], "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": tok.token_to_id(spec["bos"]) if spec["bos"] else None,
        "eos_token_id": tok.token_to_id(spec["eos"]),
    }
    if spec["model_type"] == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if spec["model_type"] == "qwen3":
        cfg.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                   max_window_layers=spec["layers"])
    if spec["model_type"] == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec["layers"])
    return cfg


def make_weights(spec, cfg, seed):
    gen = torch.Generator().manual_seed(seed)

    def linear(out_dim, in_dim):
        return torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim)

    def norm(dim):
        return 1.0 + 0.1 * torch.randn(dim, generator=gen)

    h, hd, v = spec["hidden"], spec["head_dim"], cfg["vocab_size"]
    q_dim, kv_dim = spec["heads"] * hd, spec["kv_heads"] * hd
    # Embedding rows of norm ~1: with tied embeddings they are also the output projection, and
    # unit-variance rows would give logits of O(sqrt(hidden)) and a degenerate greedy decode.
    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen) / math.sqrt(h)}
    for i in range(spec["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = linear(q_dim, h)
        w[p + "self_attn.k_proj.weight"] = linear(kv_dim, h)
        w[p + "self_attn.v_proj.weight"] = linear(kv_dim, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, q_dim)
        if spec["bias"]:
            w[p + "self_attn.q_proj.bias"] = 0.1 * torch.randn(q_dim, generator=gen)
            w[p + "self_attn.k_proj.bias"] = 0.1 * torch.randn(kv_dim, generator=gen)
            w[p + "self_attn.v_proj.bias"] = 0.1 * torch.randn(kv_dim, generator=gen)
        if spec["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = linear(spec["intermediate"], h)
        w[p + "mlp.up_proj.weight"] = linear(spec["intermediate"], h)
        w[p + "mlp.down_proj.weight"] = linear(h, spec["intermediate"])
    w["model.norm.weight"] = norm(h)
    if not spec["tie"]:
        w["lm_head.weight"] = linear(v, h)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    return {k: t.to(dtype[spec["dtype"]]).contiguous() for k, t in w.items()}


def save_weights(weights, out_dir, shards):
    names = list(weights)
    if shards == 1:
        save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def make_model(name, out_root, seed):
    spec = SPECS[name]
    out_dir = os.path.join(out_root, name)
    os.makedirs(out_dir, exist_ok=True)
    tok = train_tokenizer(spec)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = make_config(spec, tok)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": spec["max_pos"],
        "bos_token": spec["bos"], "eos_token": spec["eos"], "pad_token": spec["eos"],
        "chat_template": spec["template"], "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
    save_weights(make_weights(spec, cfg, seed), out_dir, spec["shards"])
    print(f"{name}: vocab {cfg['vocab_size']} (tokenizer {tok.get_vocab_size()}), "
          f"{spec['dtype']}, {spec['shards']} shard(s) -> {out_dir}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write model folders into")
    parser.add_argument("--models", default=",".join(SPECS), help="comma-separated names")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    for i, name in enumerate(args.models.split(",")):
        if name not in SPECS:
            parser.error(f"unknown model '{name}' (known: {', '.join(SPECS)})")
        make_model(name, args.out, args.seed + i)


if __name__ == "__main__":
    main()
