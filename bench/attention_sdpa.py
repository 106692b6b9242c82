#!/usr/bin/env python3
"""PyTorch SDPA on the decode shapes of bench/attention_decode.cc, for the same device call.

One query token per sequence against contiguous bf16 K/V (the layout SDPA takes), GQA through
enable_gqa=True, timed with CUDA events around each call after a warm-up; median reported.
Writes JSON: {"device", "torch", "points": [{"context", "median_ms", ...}]}.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "points": []}
    for context in [int(c) for c in args.contexts.split(",")]:
        q = torch.empty(args.batch, args.heads, 1, args.head_dim, device=device, dtype=torch.bfloat16).uniform_(-1, 1)
        k = torch.empty(args.batch, args.kv_heads, context, args.head_dim, device=device, dtype=torch.bfloat16).uniform_(-1, 1)
        v = torch.empty_like(k).uniform_(-1, 1)
        times = []
        for i in range(args.warmup + args.iterations):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            stop.record()
            stop.synchronize()
            if i >= args.warmup:
                times.append(start.elapsed_time(stop))
        median = statistics.median(times)
        kv_bytes = 2 * args.batch * context * args.kv_heads * args.head_dim * 2
        report["points"].append({"context": context, "median_ms": median, "min_ms": min(times),
                                 "kv_bytes": kv_bytes,
                                 "kv_read_bytes_per_s": kv_bytes / (median / 1e3)})
        print(f"sdpa context {context:7d}: {median:.4f} ms, K+V read {kv_bytes / median / 1e6:.0f} GB/s", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
