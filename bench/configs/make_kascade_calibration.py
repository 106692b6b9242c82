#!/usr/bin/env python3
"""Writes a synthetic Kascade calibration for benchmarks at real model shapes with random
weights, where a calibration by `rubato calibrate kascade` would be meaningless: the anchors are
given (default: the paper's Qwen3-8B set, the Kascade paper §4), the head map is the identity
and S / importance are placeholders (recorded as such). Not for accuracy runs.

  python3 bench/configs/make_kascade_calibration.py --model configs/models/qwen3-8b \
      --anchors 0,2,7,14,23 --out bench/configs/kascade_qwen3_8b_paper_anchors.json
"""
import argparse
import json
import os


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="folder with config.json")
    p.add_argument("--anchors", default="0,2,7,14,23")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    kv_heads = config["num_key_value_heads"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    anchors = [int(a) for a in args.anchors.split(",")]
    calibration = {
        "format": "rubato-kascade-calibration", "version": 1,
        "model": {"path": args.model, "num_layers": layers, "num_heads": heads,
                  "num_kv_heads": kv_heads, "head_dim": head_dim},
        "dev_set": {"path": "(synthetic: anchors given, identity head map)",
                    "fnv1a64": "0000000000000000", "prompts": 0},
        "top_k": 64, "anchors": anchors,
        "head_map": [list(range(kv_heads)) for _ in range(layers)],
        "importance": [1.0] * layers,
        "similarity": [[0.0] * layers for _ in range(layers)],
        "head_similarity": [],
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(calibration, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
