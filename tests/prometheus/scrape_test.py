#!/usr/bin/env python3
"""A real Prometheus (Debian `prometheus`, loopback only) scrapes `rubato serve` and a cache rank
every second while this test sends requests; then every expression of the Grafana dashboard
(helm/rubato/dashboards/rubato.json) is queried through Prometheus's HTTP API and must evaluate,
the request and token counters must equal what was sent, and `promtool check metrics` on both
/metrics endpoints may warn only about the ':' in rubato's metric names.

    tests/prometheus/scrape_test.py BUILD_DIR/inference_rank/rubato
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

MODEL = "models/tiny-qwen3-longctx"
DASHBOARD = "helm/rubato/dashboards/rubato.json"
REQUESTS = 6


def fail(message):
    print(f"FAIL {message}")
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, log_path):
    log = open(log_path, "w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(log_path, pattern, process, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        with open(log_path) as f:
            match = re.search(pattern, f.read())
        if match:
            return match
        if process.poll() is not None:
            break
        time.sleep(0.1)
    with open(log_path) as f:
        fail(f"no '{pattern}' from {process.args[0]}:\n{f.read()[-2000:]}")


def http(url, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()


def dashboard_expressions():
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    exprs.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    with open(DASHBOARD) as f:
        walk(json.load(f))
    # Grafana's variables: the rate interval a concrete window, the selectors anything.
    return [e.replace("$__rate_interval", "1m").replace("$namespace", ".*")
            .replace("$model_name", ".*") for e in exprs]


def query(prometheus, expr):
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        reply = json.loads(http(url))
    except urllib.error.HTTPError as error:
        return None, error.read().decode()[:300]
    return reply["data"]["result"], None


def scalar(prometheus, expr):
    result, error = query(prometheus, expr)
    if error or not result:
        return None
    return float(result[0]["value"][1])


def poll(condition, seconds, message):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.5)
    fail(message())


def both_up(prometheus):
    up, _ = query(prometheus, "up")
    return up is not None and len(up) == 2 and all(s["value"][1] == "1" for s in up)


def check_metrics_text(name, text):
    """promtool's lint of one /metrics page: only the ':' naming warning is allowed."""
    run = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                         text=True)
    problems = [line for line in (run.stdout + run.stderr).splitlines()
                if line.strip() and "colon" not in line and "should not contain ':'" not in line]
    if problems:
        fail(f"promtool check metrics on {name}: " + "; ".join(problems[:10]))
    print(f"ok   promtool check metrics on {name}")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rubato = sys.argv[1]
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            fail(f"{tool} not found (scripts/setup --test installs Debian's prometheus)")
    work = tempfile.mkdtemp(prefix="rubato_prometheus_")
    processes = []
    try:
        cache = start([rubato, "cache", "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"],
                      f"{work}/cache.log")
        processes.append(cache)
        endpoint = wait_for(f"{work}/cache.log", r"listening on (\S+)", cache).group(1)
        cache_metrics = wait_for(f"{work}/cache.log", r"metrics on (http://\S+)/metrics",
                                 cache).group(1)
        serve = start([rubato, "serve", "--model", MODEL, "--port", "0", "--threads", "1",
                       "--cache", endpoint, "--kv-residency", "offloaded"], f"{work}/serve.log")
        processes.append(serve)
        api = wait_for(f"{work}/serve.log", r"listening on (http://[0-9.:]+)", serve).group(1)

        port = free_port()
        with open(f"{work}/prometheus.yml", "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n"
                    f"  - job_name: inference\n    static_configs:\n"
                    f"      - targets: ['{api[len('http://'):]}']\n"
                    f"  - job_name: cache\n    static_configs:\n"
                    f"      - targets: ['{cache_metrics[len('http://'):]}']\n")
        prometheus = start(["prometheus", f"--config.file={work}/prometheus.yml",
                            f"--storage.tsdb.path={work}/data",
                            f"--web.listen-address=127.0.0.1:{port}"], f"{work}/prometheus.log")
        processes.append(prometheus)
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{work}/prometheus.log", r"Server is ready to receive web requests", prometheus)
        # Target discovery settles a few seconds after start: wait until both are scraped.
        poll(lambda: both_up(base), 90, lambda: "Prometheus does not scrape both targets: " +
             http(f"{base}/api/v1/targets")[:1500])
        print("ok   both targets up")

        model_id = json.loads(http(f"{api}/v1/models"))["data"][0]["id"]
        prompt_tokens = completion_tokens = 0
        for i in range(REQUESTS):
            reply = json.loads(http(f"{api}/v1/completions", {
                "model": model_id, "prompt": f"Request {i}: the pass key is 4711. The pass key is",
                "max_tokens": 4 + i, "temperature": 0}))
            prompt_tokens += reply["usage"]["prompt_tokens"]
            completion_tokens += reply["usage"]["completion_tokens"]
        # The scrape after the last request.
        poll(lambda: scalar(base, "sum(rubato:request_success_total)") == REQUESTS, 60,
             lambda: f"sum(rubato:request_success_total) stays at "
                     f"{scalar(base, 'sum(rubato:request_success_total)')}, {REQUESTS} sent")

        for name, url in (("rubato serve", api), ("the cache rank", cache_metrics)):
            check_metrics_text(name, http(f"{url}/metrics"))

        failed = []
        for expr in dashboard_expressions():
            _, error = query(base, expr)
            if error:
                failed.append(f"{expr}: {error}")
        if failed:
            fail("dashboard expressions Prometheus refused:\n  " + "\n  ".join(failed))
        print(f"ok   {len(dashboard_expressions())} dashboard expressions evaluate")

        expected = {
            "sum(rubato:request_success_total)": REQUESTS,
            "sum(rubato:prompt_tokens_total)": prompt_tokens,
            "sum(rubato:generation_tokens_total)": completion_tokens,
            "sum(rubato:time_to_first_token_seconds_count)": REQUESTS,
            "sum(rubato:e2e_request_latency_seconds_count)": REQUESTS,
            "sum(rubato:request_queue_time_seconds_count)": REQUESTS,
            "sum(rubato:request_prefill_time_seconds_count)": REQUESTS,
            "sum(rubato:request_decode_time_seconds_count)": REQUESTS,
            "sum(rubato:request_prompt_tokens_sum)": prompt_tokens,
            "sum(rubato:request_generation_tokens_sum)": completion_tokens,
            "sum(rubato:requests_failed_total)": 0,
            "sum(rubato:cache_link_up)": 1,
            "count(rubato:build_info)": 2,
            "count(process_open_fds > 0)": 2,
        }
        for expr, want in expected.items():
            got = scalar(base, expr)
            if got is None or abs(got - want) > 1e-9:
                fail(f"{expr} is {got}, {want} sent")
            print(f"ok   {expr} = {want}")
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    print("prometheus scrape: all checks passed")


if __name__ == "__main__":
    main()
