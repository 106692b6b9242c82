#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers for rubato's golden parity test.

For each model directory: tokenizes a fixed >= 100-token prompt with the model's own
tokenizer.json (HF `tokenizers`), runs the prefill in fp32 on the CPU with eager attention
and records the logits of every prompt position, then runs 32 greedy decode steps through the
KV cache recording each step's logits and token. Writes, per model, into OUT/<name>/:
  meta.json            prompt text, prompt ids, decode ids, shapes, library versions, and the
                       smallest top-1/top-2 logit margin seen (greedy ties would make the
                       token comparison meaningless)
  prefill_logits.f32   [prompt_tokens][vocab] little-endian float32
  decode_logits.f32    [32][vocab]: row i is the distribution token i was taken from
                       (row 0 equals the last prefill row)
Run on the GPU machine (it has torch + transformers): scripts/gpu/golden.sh.
Usage: hf_golden.py --model DIR [--model DIR ...] --out OUT
"""
import argparse
import json
import os
import platform

import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPT = (
    "The lighthouse keeper wrote in the log every evening. On the first night of the storm, "
    "the wind turned from the west, the lamp flickered twice, and the supply boat did not "
    "arrive. He counted the remaining oil: 41 litres, enough for nine nights if the weather "
    "held. On the second night he repaired the shutter, fed the cat, and listened to the "
    "radio for news of the harbour. Nobody answered his call at 21:30, so he tried again "
    "at 22:00 and at midnight.\nThe next morning, the keeper"
)
DECODE_STEPS = 32


def load_model(model_dir):
    kwargs = dict(attn_implementation="eager")
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    except TypeError:  # transformers 4 spells it torch_dtype
        return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, **kwargs)


def margin(logits_row):
    top2 = torch.topk(logits_row, 2).values
    return float(top2[0] - top2[1])


@torch.no_grad()
def run(model_dir, out_root):
    name = os.path.basename(os.path.normpath(model_dir))
    tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False).ids
    assert len(prompt_ids) >= 100, f"{name}: prompt has only {len(prompt_ids)} tokens"
    model = load_model(model_dir).eval()

    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, use_cache=True)
    prefill = out.logits[0].float()  # [prompt_tokens][vocab]
    past = out.past_key_values
    rows, tokens = [prefill[-1]], []
    for step in range(DECODE_STEPS):
        token = int(torch.argmax(rows[-1]))
        tokens.append(token)
        if step + 1 == DECODE_STEPS:
            break
        out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        rows.append(out.logits[0, -1].float())
    decode = torch.stack(rows)  # [DECODE_STEPS][vocab]

    out_dir = os.path.join(out_root, name)
    os.makedirs(out_dir, exist_ok=True)
    prefill.contiguous().numpy().astype("<f4").tofile(os.path.join(out_dir, "prefill_logits.f32"))
    decode.contiguous().numpy().astype("<f4").tofile(os.path.join(out_dir, "decode_logits.f32"))
    meta = {
        "model": name,
        "prompt": PROMPT,
        "prompt_ids": prompt_ids,
        "decode_ids": tokens,
        "vocab_size": int(prefill.shape[1]),
        "prefill_rows": int(prefill.shape[0]),
        "decode_rows": int(decode.shape[0]),
        "min_decode_margin": min(margin(r) for r in decode),
        "max_abs_logit": float(max(prefill.abs().max(), decode.abs().max())),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "python_version": platform.python_version(),
        "compute": "fp32 on CPU, attn_implementation=eager",
        "decode_text": tok.decode(tokens, skip_special_tokens=False),
    }
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{name}: {len(prompt_ids)} prompt tokens, decode {tokens[:8]}..., "
          f"min margin {meta['min_decode_margin']:.4f}, max |logit| {meta['max_abs_logit']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    for model_dir in args.model:
        run(model_dir, args.out)


if __name__ == "__main__":
    main()
