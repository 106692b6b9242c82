#!/usr/bin/env python3
"""Measures what delta replies save on the wire (docs/disaggregated.md "Delta replies"): runs
`rubato generate` with offloaded KV (the colocated cache rank, CPU engine) and oracle_topk on
accuracy-suite prompts, once with topology.delta_replies true and once false, and writes the
bytes the cache rank sent back per step each way against what full replies carry (the client
counts both), the compact rows, and whether both runs gave the same tokens. Measures only;
asserts nothing.

Usage:
  bench/accuracy/generate.py --model models/qwen3-yardstick-16k --rubato build/inference_rank/rubato \
      --tasks vartrack --lengths 4096,16384 --context 16384 --depths 0.5 --instances 1 --seed 0 \
      --out /tmp/vt.jsonl
  bench/delta_reply_bytes.py --rubato build/inference_rank/rubato --model models/qwen3-yardstick-16k \
      --tasks /tmp/vt.jsonl --out bench/results/delta_reply_bytes_yardstick.json [--decode-only]
"""
import argparse
import json
import os
import re
import subprocess
import tempfile
import time


def run(args, prompt, delta):
    config = (f"policy: {{name: oracle_topk, top_k: {args.top_k}, sink_tokens: {args.sink}, "
              f"recent_window: {args.recent}}}\n"
              f"topology: {{delta_replies: {'true' if delta else 'false'}}}\n")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config)
        path = f.name
    start = time.time()
    done = subprocess.run(
        [args.rubato, "generate", "--config", path, "--kv-residency", "offloaded", "--model",
         args.model, "--prompt", prompt, "--max-tokens", str(args.max_tokens), "--threads",
         str(args.threads), "--output-ids"], capture_output=True, text=True, check=True)
    os.unlink(path)
    lines = (done.stdout + done.stderr).splitlines()
    stats_line = next(line for line in lines if line.startswith("[rubato]"))
    tokens = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("[rubato]"))
    return tokens.strip(), dict(re.findall(r"(\w+)=(\S+)", stats_line)), time.time() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rubato", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tasks", required=True, help="JSON lines of bench/accuracy/generate.py")
    parser.add_argument("--out", required=True)
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--recent", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=26)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode-only", action="store_true",
                        help="also run with --max-tokens 1 (prefill only) and report the decode "
                             "steps' bytes alone: the difference of the two runs' totals")
    parser.add_argument("--full-too", action="store_true",
                        help="also run with delta_replies false (checks the tokens and bytes)")
    args = parser.parse_args()
    points = []
    for line in open(args.tasks):
        task = json.loads(line)
        tokens, stats, seconds = run(args, task["prompt"], True)
        steps = int(stats["offload_steps"])
        point = {
            "id": task["id"], "prompt_tokens": task["prompt_tokens"],
            "generated_tokens": int(stats["generated_tokens"]), "offload_steps": steps,
            "bytes_back_per_step_delta": float(stats["step_bytes_received"]),
            "bytes_back_per_step_full": float(stats["step_full_reply_bytes"]),
            "bytes_out_per_step": float(stats["step_bytes_sent"]),
            "compact_rows_received": int(stats["compact_rows_received"]),
            "compact_rows_full": int(stats["compact_rows_full"]),
            "exposed_wait_ms_per_step": float(stats["step_wait_ms"]),
            "wall_s": round(seconds, 1),
        }
        point["bytes_fraction"] = point["bytes_back_per_step_delta"] / point[
            "bytes_back_per_step_full"]
        point["rows_fraction"] = point["compact_rows_received"] / point["compact_rows_full"]
        if args.decode_only:
            # The same prompt with one generated token: its steps are the prefill chunks alone
            # (the first token comes from the last chunk's logits), so the difference of the
            # totals is what the decode steps moved.
            one = argparse.Namespace(**{**vars(args), "max_tokens": 1})
            _, prefill, _ = run(one, task["prompt"], True)
            prefill_steps = int(prefill["offload_steps"])

            def total(stats, key, count):  # a run without decode steps prints no reply bytes
                return float(stats.get(key, 0)) * count

            delta = (total(stats, "step_bytes_received", steps) -
                     total(prefill, "step_bytes_received", prefill_steps))
            full = (total(stats, "step_full_reply_bytes", steps) -
                    total(prefill, "step_full_reply_bytes", prefill_steps))
            decode_steps = steps - prefill_steps
            point.update({
                "prefill_steps": prefill_steps, "decode_steps": decode_steps,
                "decode_bytes_back_per_step_delta": delta / max(decode_steps, 1),
                "decode_bytes_back_per_step_full": full / max(decode_steps, 1),
                "decode_bytes_fraction": delta / full if full > 0 else None,
                "decode_rows_fraction":
                    (int(stats["compact_rows_received"]) -
                     int(prefill.get("compact_rows_received", 0))) /
                    max(1, int(stats["compact_rows_full"]) - int(prefill.get("compact_rows_full", 0))),
            })
        if args.full_too:
            full_tokens, full_stats, full_seconds = run(args, task["prompt"], False)
            point["full_run_bytes_back_per_step"] = float(full_stats["step_bytes_received"])
            point["same_tokens_as_full_replies"] = full_tokens == tokens
            point["full_run_wall_s"] = round(full_seconds, 1)
        print(json.dumps(point))
        points.append(point)
    report = {"what": "delta replies against full compact replies, offloaded oracle_topk, "
                      "colocated cache rank, CPU engine",
              "model": args.model, "top_k": args.top_k, "sink_tokens": args.sink,
              "recent_window": args.recent, "points": points}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
