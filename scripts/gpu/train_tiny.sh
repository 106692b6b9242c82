#!/usr/bin/env bash
# Trains (or resumes training of) the bundled tiny model on the GPU machine.
# Device call: command "bash scripts/gpu/train_tiny.sh [train.py flags]",
#   carry [".cache/corpus", ".cache/train_ckpt"] (the second only when resuming).
# Before the first call, here: tools/train_tiny/extract_corpus.sh && gzip -k .cache/corpus/train.txt
# After a call: if it printed RESUME, copy $OUT's ckpt.part* into .cache/train_ckpt/ and call
# again; once it printed DONE, unpack model.tgz into models/ (see tools/train_tiny/README.md).
set -euo pipefail
out=${OUT:?OUT must be set (the device tool sets it)}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
resume=()
if [ -f .cache/train_ckpt/ckpt.part0 ]; then resume=(--resume .cache/train_ckpt); fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 tools/train_tiny/train.py --out "$out" "${resume[@]}" "$@" 2>&1 | tee "$out/train.log"
if [ -d "$out/model" ]; then
  tar czf "$out/model.tgz" -C "$out" model
  rm -rf "$out/model"
fi
ls -la "$out"
