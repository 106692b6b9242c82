#!/usr/bin/env python3
"""Losing one of three GPU cache ranks on the device (docs/disaggregated.md "Several GPU cache
ranks"): three `rubato cache --memory device` processes (GPUs 1-3, or all on GPU 1 with two
GPUs) behind `rubato serve` on GPU 0 over the NCCL device data plane; three long streams, one
placed on each rank by free budget; the second rank is killed (SIGKILL) mid-stream. Passes when
exactly one stream ends with an error naming "cache rank 1 of 3", the other two finish with the
text a local dense server gives, and /health stays 200. Prints one JSON line and exits 1 on a
failed check.

  python3 scripts/gpu/lose_cache_rank.py --rubato build-gpu/inference_rank/rubato
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

MODEL = "models/tiny-qwen3-longctx"
PROMPTS = ["The passkey is 4711. Remember it. " * 8, "Once upon a time, " * 12,
           "A list of prime numbers: 2, 3, 5, 7, 11, " * 4]


def wait_health(port, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:
            time.sleep(0.5)
    return False


def health_code(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return -1


def stream(port, prompt, max_tokens, out, started):
    """One streaming completion: its text, its error events, whether it ended with [DONE]."""
    out.update(text="", errors=[], done=False, finish=None, chunks=0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out["errors"].append(json.dumps(event["error"]))
                    continue
                choice = event["choices"][0]
                out["text"] += choice.get("text", "")
                out["finish"] = choice.get("finish_reason") or out["finish"]
                out["chunks"] += 1
                if out["chunks"] == 10:
                    started.release()
    except Exception as e:  # the check below reports it
        out["errors"].append(f"client: {e}")
    finally:
        if out["chunks"] < 10:
            started.release()


def serve(rubato, config_path, port, log):
    return subprocess.Popen([rubato, "serve", "--config", config_path, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rubato", default="build-gpu/inference_rank/rubato")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: nvidia-smi's count)")
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--logs", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    gpus = args.gpus or len(subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                           text=True).stdout.strip().splitlines())
    if gpus < 2:
        print(json.dumps({"ok": False, "why": f"needs two GPUs, found {gpus}"}))
        return 1
    devices = [1, 2, 3] if gpus >= 4 else [1, 1, 1]
    ports = [47401, 47402, 47403]
    work = tempfile.mkdtemp()
    procs, result, ok = [], {"devices": devices}, True
    try:
        caches = []
        for i, (port, device) in enumerate(zip(ports, devices)):
            log = open(os.path.join(args.logs, f"lose_cache_rank_cache{i}.log"), "w")
            caches.append(subprocess.Popen(
                [args.rubato, "cache", "--listen", f"127.0.0.1:{port}", "--memory", "device",
                 "--device", str(device), "--budget-mb", "4096"], stdout=log,
                stderr=subprocess.STDOUT))
        procs += caches
        time.sleep(3)
        configs = {}
        for name, topology in [
                ("offloaded", {"mode": "disaggregated", "transport": "nccl",
                               "cache_endpoints": [f"127.0.0.1:{p}" for p in ports]}),
                ("local", {"mode": "colocated"})]:
            path = os.path.join(work, f"{name}.yaml")
            with open(path, "w") as f:
                json.dump({"model": {"path": MODEL},
                           "engine": {"backend": "cuda", "device": 0, "max_batch": 4},
                           "topology": topology,
                           "limits": {"rpc_timeout_ms": 30000, "heartbeat_ms": 100}}, f)
            configs[name] = path
        log = open(os.path.join(args.logs, "lose_cache_rank_serve.log"), "w")
        server = serve(args.rubato, configs["offloaded"], 47480, log)
        procs.append(server)
        if not wait_health(47480, 120):
            print(json.dumps({"ok": False, "why": "rubato serve did not come up (logs)"}))
            return 1
        outs = [dict() for _ in PROMPTS]
        started = threading.Semaphore(0)
        threads = []
        for i, prompt in enumerate(PROMPTS):
            thread = threading.Thread(target=stream,
                                      args=(47480, prompt, args.max_tokens, outs[i], started))
            thread.start()
            threads.append(thread)
            time.sleep(0.3)  # admitted in order: placement puts one on each rank
        for _ in PROMPTS:
            started.acquire(timeout=120)
        caches[1].send_signal(signal.SIGKILL)
        result["killed"] = "cache rank 1 (port %d, GPU %d)" % (ports[1], devices[1])
        for thread in threads:
            thread.join(timeout=300)
        result["health_after"] = health_code(47480)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        # The same prompts on a local dense server.
        log = open(os.path.join(args.logs, "lose_cache_rank_local.log"), "w")
        local = serve(args.rubato, configs["local"], 47481, log)
        procs.append(local)
        wait_health(47481, 120)
        dense = [dict() for _ in PROMPTS]
        for i, prompt in enumerate(PROMPTS):
            stream(47481, prompt, args.max_tokens, dense[i], threading.Semaphore(0))
        failed = [i for i, o in enumerate(outs) if o["errors"]]
        result["streams"] = [{"errors": o["errors"], "done": o["done"], "finish": o["finish"],
                              "chunks": o["chunks"], "equals_local_dense": o["text"] == d["text"]}
                             for o, d in zip(outs, dense)]
        ok = (len(failed) == 1 and any("cache rank 1 of 3" in e for e in outs[failed[0]]["errors"])
              and all(outs[i]["text"] == dense[i]["text"] and outs[i]["finish"] == "length"
                      for i in range(len(PROMPTS)) if i not in failed)
              and result["health_after"] == 200)
        result["ok"] = ok
        print(json.dumps(result))
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
