#!/usr/bin/env bash
# Produces every committed reference that needs PyTorch / transformers / tokenizers, on the
# GPU machine (docs/design.md §9), in one call:
#   1. the tiny random checkpoints (tools/model_maker/make_tiny_model.py)
#   2. transformers reference logits for each (tools/golden/hf_golden.py)
#   3. HF tokenizers reference ids for the Qwen3 / Llama-3 parity set
#      (tools/golden/tokenizer_reference.py; needs .cache/tokenizers carried:
#       run scripts/fetch-test-tokenizers here first)
# Everything lands in $OUT/golden.tgz; unpack it at the repo root:
#   tar xzf golden.tgz   (-> models/, tests/data/models/, tests/data/golden/, tests/data/tokenizer/)
# Device call: command "bash scripts/gpu/golden.sh", carry [".cache/tokenizers"].
set -euo pipefail
out=${OUT:?OUT must be set (the device tool sets it)}
stage=$(mktemp -d)
export PYTHONUNBUFFERED=1

python3 tools/model_maker/make_tiny_model.py --out "$stage/models"
mkdir -p "$stage/tree/models" "$stage/tree/tests/data/models" "$stage/tree/tests/data/golden"
cp -r "$stage/models/tiny-qwen3-random" "$stage/tree/models/"
cp -r "$stage/models/tiny-llama3-random" "$stage/models/tiny-qwen2-random" \
  "$stage/tree/tests/data/models/"

python3 tools/golden/hf_golden.py --out "$stage/tree/tests/data/golden" \
  --model "$stage/models/tiny-qwen3-random" \
  --model "$stage/models/tiny-llama3-random" \
  --model "$stage/models/tiny-qwen2-random"

if [ -d .cache/tokenizers ]; then
  mkdir -p "$stage/tree/tests/data/tokenizer"
  for name in qwen3 llama3; do
    python3 tools/golden/tokenizer_reference.py --tokenizer ".cache/tokenizers/$name" \
      --strings tests/data/tokenizer/strings.json --name "$name" \
      --out "$stage/tree/tests/data/tokenizer/ref_$name.json"
  done
else
  echo "warning: .cache/tokenizers not carried; tokenizer references skipped" >&2
fi

tar czf "$out/golden.tgz" -C "$stage/tree" .
tar tzvf "$out/golden.tgz"
