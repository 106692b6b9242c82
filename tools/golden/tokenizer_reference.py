#!/usr/bin/env python3
"""Golden reference for rubato's tokenizer parity test, from Hugging Face `tokenizers` (Rust).

Encodes every string of tests/data/tokenizer/strings.json with the tokenizer.json of a model
directory and writes

  {"name", "tokenizers_version", "source",
   "encode_plain":   [[ids], ...]   # encode(s, add_special_tokens=False).ids
   "encode_special": [[ids], ...]   # encode(s, add_special_tokens=True).ids
   "decode":         [str, ...]}    # decode(encode_plain[i], skip_special_tokens=False)

which common/tokenizer/tokenizer_parity_test.cc compares with rubato, id for id.

Needs Python 3 with the `tokenizers` package (the GPU machine has it). Usage, after
scripts/fetch-test-tokenizers (copy .cache/tokenizers/ along if running elsewhere):

  python3 tools/golden/tokenizer_reference.py --tokenizer .cache/tokenizers/qwen3 \
      --strings tests/data/tokenizer/strings.json --name qwen3 \
      --out tests/data/tokenizer/ref_qwen3.json
  (and the same with llama3)
"""

import argparse
import hashlib
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True,
                        help="directory holding tokenizer.json")
    parser.add_argument("--strings", required=True, help="JSON array of strings to encode")
    parser.add_argument("--name", required=True, help="name recorded in the output (qwen3, ...)")
    parser.add_argument("--out", required=True, help="output JSON path")
    args = parser.parse_args()

    try:
        import tokenizers
    except ImportError:
        print("tokenizer_reference.py: the Python package `tokenizers` is not installed "
              "(pip install tokenizers, or run this on the GPU machine)", file=sys.stderr)
        return 1

    tokenizer_path = os.path.join(args.tokenizer, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        print(f"tokenizer_reference.py: {tokenizer_path} not found "
              "(run scripts/fetch-test-tokenizers)", file=sys.stderr)
        return 1
    with open(args.strings, encoding="utf-8") as f:
        strings = json.load(f)
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        print(f"tokenizer_reference.py: {args.strings} is not a JSON array of strings",
              file=sys.stderr)
        return 1

    with open(tokenizer_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    tokenizer = tokenizers.Tokenizer.from_file(tokenizer_path)

    encode_plain, encode_special, decoded = [], [], []
    for text in strings:
        plain = tokenizer.encode(text, add_special_tokens=False).ids
        encode_plain.append(plain)
        encode_special.append(tokenizer.encode(text, add_special_tokens=True).ids)
        decoded.append(tokenizer.decode(plain, skip_special_tokens=False))

    result = {
        "name": args.name,
        "tokenizers_version": tokenizers.__version__,
        "source": f"{os.path.basename(os.path.normpath(args.tokenizer))}/tokenizer.json "
                  f"sha256:{digest}",
        "encode_plain": encode_plain,
        "encode_special": encode_special,
        "decode": decoded,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)
        f.write("\n")
    print(f"tokenizer_reference.py: wrote {len(strings)} strings to {args.out} "
          f"(tokenizers {tokenizers.__version__})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
