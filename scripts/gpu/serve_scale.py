#!/usr/bin/env python3
"""Serving at scale as a new user runs it (docs/benchmarks.md "Serving at scale"): `rubato serve`
with random weights at a real config's shapes, `engine.max_batch` 256 and no `max_context` (the
KV pool sized from free memory), loaded by `rubato bench serve` at several concurrencies (1024
tokens in, 256 out by default). Writes one JSON with each level's vLLM-style result keys, the
pool line serve printed at start, the device, the commit and the command.

  python3 scripts/gpu/serve_scale.py --rubato build-gpu/inference_rank/rubato \
      --config-dir configs/models/qwen3-8b --out bench/results/serve_scale_qwen3-8b_h200.json

The model directory is a temporary copy of the config's config.json beside a tokenizer grown from
--tokenizer-from's to the config's vocabulary (serve needs one; prompts travel as token ids).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def synthetic_tokenizer(template, vocab_size):
    """The template's byte-level BPE tokenizer grown to `vocab_size` ids: its special tokens and
    byte symbols, then every pair and as many triples of printable ASCII (space included) as fill
    the rest, each with its merge. Random ids then detokenise to text almost always, so the
    server streams a chunk per token, as it does with a real model's tokenizer."""
    vocab = {k: v for k, v in template["model"]["vocab"].items()
             if len(k) == 1 or k in {t["content"] for t in template.get("added_tokens", [])}}
    symbols = [chr(c) for c in range(33, 127)] + ["\u0120"]  # GPT-2's byte map: 'Ġ' is a space
    merges = []
    def add(left, right):
        if len(vocab) < vocab_size:
            vocab[left + right] = len(vocab)
            merges.append([left, right])
    pairs = [a + b for a in symbols for b in symbols]
    for a in symbols:
        for b in symbols:
            add(a, b)
    for pair in pairs:
        for c in symbols:
            add(pair, c)
    if len(vocab) != vocab_size:
        sys.exit(f"synthetic tokenizer: {len(vocab)} ids, not {vocab_size}")
    tokenizer = dict(template)
    tokenizer["model"] = dict(template["model"], vocab=vocab, merges=merges)
    return tokenizer


def wait_listening(proc, lines, seconds):
    """The port serve printed, or None when it exits or the time runs out."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        for line in list(lines):
            if "listening on http://" in line:
                return int(line.rsplit(":", 1)[1])
        if proc.poll() is not None:
            return None
        time.sleep(0.5)
    return None


def pump(stream, lines, log):
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        lines.append(line)
        log.write(line + "\n")
        log.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rubato", required=True)
    parser.add_argument("--config-dir", default="configs/models/qwen3-8b")
    parser.add_argument("--tokenizer-from", default="models/tiny-qwen3-random")
    parser.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--prompts-per-slot", type=int, default=2,
                        help="requests per level = max(4, this x concurrency)")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--device", default="")
    parser.add_argument("--commit", default="")
    parser.add_argument("--log", default="serve_scale.log")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="rubato-serve-scale-")
    model = os.path.join(work, "model")
    os.makedirs(model)
    shutil.copy(os.path.join(args.config_dir, "config.json"), model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    shutil.copy(os.path.join(args.tokenizer_from, "tokenizer_config.json"), model)
    with open(os.path.join(args.tokenizer_from, "tokenizer.json")) as f:
        template = json.load(f)
    with open(os.path.join(model, "tokenizer.json"), "w") as f:
        json.dump(synthetic_tokenizer(template, vocab), f)
    config = os.path.join(work, "serve.yaml")
    with open(config, "w") as f:
        f.write(f"model:\n  path: {model}\n  random_weights: true\n"
                f"engine:\n  backend: {args.backend}\n  max_batch: {args.max_batch}\n"
                "server:\n  request_queue: 4096\nlimits:\n  max_queue: 100000\n"
                "logging:\n  level: info\n")

    lines = []
    log = open(args.log, "w")
    serve = subprocess.Popen([args.rubato, "serve", "--config", config, "--port", "0"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    threading.Thread(target=pump, args=(serve.stdout, lines, log), daemon=True).start()
    result = {"benchmark": "serve_scale", "device": args.device, "commit": args.commit,
              "command": " ".join(sys.argv), "config_dir": args.config_dir,
              "max_batch": args.max_batch, "input_len": args.input_len,
              "output_len": args.output_len, "levels": []}
    try:
        port = wait_listening(serve, lines, args.start_timeout)
        result["serve_start"] = [l for l in lines if "KV pool" in l or "listening" in l]
        if port is None:
            result["error"] = "serve did not start: " + " | ".join(lines[-5:])
            return finish(result, args.out, 1)
        for level in [int(c) for c in args.concurrency.split(",")]:
            prompts = max(4, args.prompts_per_slot * level)
            path = os.path.join(work, f"level_{level}.json")
            command = [args.rubato, "bench", "serve", "--port", str(port),
                       "--random-input-len", str(args.input_len),
                       "--random-output-len", str(args.output_len), "--ignore-eos",
                       "--num-prompts", str(prompts), "--max-concurrency", str(level),
                       "--vocab-limit", str(vocab),
                       "--percentile-metrics", "ttft,tpot,itl,e2el",
                       "--metric-percentiles", "50,90,99", "--result-file", path]
            started = time.time()
            run = subprocess.run(command, capture_output=True, text=True)
            log.write(run.stdout + run.stderr)
            entry = {"concurrency": level, "num_prompts": prompts, "rc": run.returncode,
                     "wall_s": round(time.time() - started, 2)}
            if run.returncode == 0 and os.path.exists(path):
                with open(path) as f:
                    entry["result"] = json.load(f)
            else:
                entry["error"] = (run.stderr or run.stdout)[-400:]
            result["levels"].append(entry)
            print(json.dumps({k: entry.get(k) for k in ("concurrency", "rc", "wall_s")}),
                  flush=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            result["metrics"] = [l for l in r.read().decode().splitlines()
                                 if l.startswith(("rubato:num_preemptions",
                                                  "rubato:kv_cache_pool_tokens"))]
        failed = any(level["rc"] != 0 for level in result["levels"])
        return finish(result, args.out, 1 if failed else 0)
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
        shutil.rmtree(work, ignore_errors=True)


def finish(result, out, code):
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"out": out, "levels": len(result["levels"]),
                      "error": result.get("error")}))
    return code


if __name__ == "__main__":
    sys.exit(main())
