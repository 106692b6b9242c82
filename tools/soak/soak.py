#!/usr/bin/env python3
"""Soak test: `rubato serve` with its KV on a cache rank, driven with mixed traffic for a while.

Starts `rubato cache` and `rubato serve --policy offload_dense --cache ...` on loopback, runs
worker threads that send a mix of requests (completions and chat, streamed and not, sampled and
greedy, with stop strings; requests the server must refuse with a 400; clients that hang up
mid-stream; /health, /metrics and /v1/models), samples both processes' RSS and open descriptors
every few seconds, and writes a JSON report: counts per kind, unexpected outcomes, latency
percentiles, and resources after the warm-up and at the end. Exit 1 when a check fails:
an unexpected outcome, a process that died, RSS outside +/- rss_tolerance of its post-warm-up
value, or descriptors grown by more than fd_slack. Standard library only. docs/security.md
"Soak".
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

WORDS = ("the pass key is river stone light garden number seven blue window quiet market "
         "letter morning bridge paper north table").split()


def percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100.0 * (len(ordered) - 1)))))
    return ordered[index]


def proc_stats(pid):
    """(RSS in KiB, open descriptors) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/status") as status:
            rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def start(command, pattern, timeout):
    """Starts `command`, waits for `pattern` on its stdout; returns (process, match)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    lines = []
    while time.time() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            # Keep draining both pipes so the process never blocks on a full pipe.
            for pipe in (process.stdout, process.stderr):
                threading.Thread(target=lambda p=pipe: [None for _ in p], daemon=True).start()
            return process, match
    process.kill()
    raise RuntimeError(f"{command[0]} {command[1]} did not print {pattern!r}: {''.join(lines)}"
                       f"{process.stderr.read()}")


class Driver:
    def __init__(self, port, seed):
        self.port = port
        self.lock = threading.Lock()
        self.latency = {}      # kind -> [seconds]
        self.counts = {}       # kind -> requests
        self.unexpected = []   # (kind, what)
        self.rng = random.Random(seed)

    def record(self, kind, seconds, problem=None):
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if problem is None:
                self.latency.setdefault(kind, []).append(seconds)
            else:
                self.unexpected.append((kind, problem))

    def request(self, method, path, body=None, timeout=120):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body))
        headers = {"Content-Type": "application/json"} if data is not None else {}
        connection.request(method, path, body=data, headers=headers)
        response = connection.getresponse()
        payload = response.read()
        connection.close()
        return response.status, payload

    def prompt(self, rng):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 48)))

    def one(self, rng):
        """One request of a kind drawn from the mix; records its outcome."""
        draw = rng.random()
        began = time.time()
        kind = "unknown"
        try:
            if draw < 0.35:
                kind = "completion"
                body = {"prompt": self.prompt(rng), "max_tokens": rng.randint(4, 24),
                        "temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 1 << 30)}
                status, payload = self.request("POST", "/v1/completions", body)
                ok = status == 200 and json.loads(payload)["choices"][0]["finish_reason"]
            elif draw < 0.55:
                kind = "chat_stream"
                body = {"messages": [{"role": "user", "content": self.prompt(rng)}],
                        "max_tokens": rng.randint(4, 24), "stream": True, "stop": ["stone"]}
                status, payload = self.request("POST", "/v1/chat/completions", body)
                ok = status == 200 and payload.rstrip().endswith(b"data: [DONE]")
            elif draw < 0.65:
                kind = "chat_penalties"
                body = {"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": self.prompt(rng)}],
                        "max_tokens": 16, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                        "logit_bias": {"5": -100}, "top_p": 0.9, "temperature": 0.8}
                status, payload = self.request("POST", "/v1/chat/completions", body)
                ok = status == 200 and "choices" in json.loads(payload)
            elif draw < 0.80:
                kind = "refused"
                bad = rng.choice([
                    b'{"prompt": "x", "unknown_field": 1}',
                    b'{"prompt": "x", "max_tokens": -3}',
                    b'{"prompt": ',
                    b'{"messages": [{"role": "wizard", "content": "x"}]}',
                    b'{"prompt": "x", "logit_bias": {"99999999": 1}}',
                ])
                path = "/v1/chat/completions" if b"messages" in bad else "/v1/completions"
                status, payload = self.request("POST", path, bad)
                ok = status == 400 and b'"error"' in payload
            elif draw < 0.90:
                kind = "hang_up"
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                body = json.dumps({"prompt": self.prompt(rng), "max_tokens": 64, "stream": True})
                connection.request("POST", "/v1/completions", body=body,
                                   headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                status = response.status
                response.read(1)  # the first bytes, then the client goes away
                connection.close()
                ok = status == 200
            else:
                kind = "admin"
                path = rng.choice(["/health", "/metrics", "/v1/models"])
                status, payload = self.request("GET", path)
                ok = status == 200
            self.record(kind, time.time() - began,
                        None if ok else f"status {status}: {payload[:200]!r}")
        except Exception as error:  # noqa: BLE001 - every failure is an outcome to report
            self.record(kind, time.time() - began,
                        f"{repr(error)[:300]} after {time.time() - began:.1f} s")

    def run(self, workers, seconds, seed):
        stop_at = time.time() + seconds

        def loop(index):
            rng = random.Random(seed * 1000 + index)
            while time.time() < stop_at:
                self.one(rng)

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(workers)]
        for thread in threads:
            thread.start()
        return threads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rubato", required=True, help="the rubato binary")
    parser.add_argument("--model", default="models/tiny-qwen3-longctx")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the reference sample (default: 10%% of the run)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="serve's CPU threads")
    parser.add_argument("--sample-every", type=float, default=5)
    parser.add_argument("--rss-tolerance", type=float, default=0.05)
    parser.add_argument("--fd-slack", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", help="JSON report")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else max(5.0, 0.1 * args.seconds)

    cache, match = start([args.rubato, "cache", "--listen", "127.0.0.1:0"],
                         r"listening on (\S+):(\d+)", 60)
    endpoint = f"{match.group(1)}:{match.group(2)}"
    serve, match = start([args.rubato, "serve", "--model", args.model, "--policy",
                          "offload_dense", "--cache", endpoint, "--port", "0", "--threads",
                          str(args.threads)], r"listening on \S+?:(\d+)", 120)
    port = int(match.group(1))
    processes = {"serve": serve, "cache": cache}
    driver = Driver(port, args.seed)
    began = time.time()
    threads = driver.run(args.workers, args.seconds, args.seed)
    samples = []
    reference = None
    while any(thread.is_alive() for thread in threads):
        time.sleep(args.sample_every)
        sample = {"t": round(time.time() - began, 1)}
        for name, process in processes.items():
            stats = proc_stats(process.pid) if process.poll() is None else None
            sample[name] = None if stats is None else {"rss_kib": stats[0], "fds": stats[1]}
        samples.append(sample)
        if reference is None and sample["t"] >= warmup:
            reference = sample
    for thread in threads:
        thread.join()
    end = samples[-1] if samples else None
    checks = []
    if driver.unexpected:
        checks.append(f"{len(driver.unexpected)} unexpected outcomes")
    for name, process in processes.items():
        if process.poll() is not None:
            checks.append(f"{name} exited with {process.returncode}")
            continue
        if reference is None or end is None or reference[name] is None or end[name] is None:
            checks.append(f"{name}: no resource samples after the warm-up")
            continue
        rss0, rss1 = reference[name]["rss_kib"], end[name]["rss_kib"]
        if abs(rss1 - rss0) > args.rss_tolerance * rss0:
            checks.append(f"{name}: RSS {rss0} KiB after the warm-up, {rss1} KiB at the end")
        if end[name]["fds"] > reference[name]["fds"] + args.fd_slack:
            checks.append(f"{name}: descriptors {reference[name]['fds']} -> {end[name]['fds']}")
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes.values():
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            checks.append("a process did not stop within 60 s of SIGTERM")

    latency = {kind: {"count": len(values),
                      "p50_ms": 1000 * percentile(values, 50),
                      "p90_ms": 1000 * percentile(values, 90),
                      "p99_ms": 1000 * percentile(values, 99),
                      "mean_ms": 1000 * statistics.fmean(values)}
               for kind, values in sorted(driver.latency.items())}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    report = {"benchmark": "soak", "command": " ".join(sys.argv), "seconds": args.seconds,
              "commit": commit, "machine": {"cpus": os.cpu_count(),
                                            "load_average_at_end": os.getloadavg()},
              "warmup_s": warmup, "workers": args.workers, "model": args.model,
              "requests": dict(sorted(driver.counts.items())),
              "unexpected": [f"{kind}: {what}" for kind, what in driver.unexpected[:20]],
              "unexpected_count": len(driver.unexpected), "latency": latency,
              "after_warmup": reference, "end": end, "samples": samples,
              "checks_failed": checks, "passed": not checks}
    print(json.dumps({k: report[k] for k in ("requests", "unexpected_count", "latency",
                                              "after_warmup", "end", "checks_failed")},
                     indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)
    return 0 if not checks else 1


if __name__ == "__main__":
    sys.exit(main())
