#!/usr/bin/env python3
"""Replays recorded client requests against a real `rubato serve` (ctest client_replay).

tests/fixtures/vllm_bench_serve/*.json are the requests `vllm bench serve --backend openai` and
`--backend openai-chat` send (with and without --ignore-eos, --logprobs 1); tests/fixtures/
openai_node/*.json what the official OpenAI Node SDK sent to a capturing server (docs/serving.md
"Client fixtures" says how each was obtained). Each is sent byte for byte (method, path, headers
in order, body; Host and Content-Length rewritten for this server) to `rubato serve` on the
bundled tiny model started with --api-key, and its reply is read the way that client reads it:
vLLM's StreamedResponseHandler over the raw chunks ("data: " events, [DONE], usage in the last
chunk, choices[0].text or delta.content), the SDK's JSON fields. Also: no key is a 401 with an
OpenAI error, and x-request-id comes back on every reply. Needs only python3.
    tests/client_replay/replay.py BUILD_DIR/inference_rank/rubato
"""
import http.client
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "tiny-qwen3-longctx"
API_KEY = "sk-rubato-fixture"  # what every fixture's Authorization header carries
FAILURES = []


def check(condition, what):
    if not condition:
        FAILURES.append(what)
        print("FAIL " + what)


def start_server(rubato):
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        [rubato, "serve", "--model", str(MODEL_DIR), "--port", "0", "--threads", "1",
         "--api-key", API_KEY], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 120  # the model loads first; generous on a busy machine
    while time.monotonic() < deadline:
        log.seek(0)
        for line in log.read().splitlines():
            if "listening on http://" in line:
                host_port = line.split("listening on http://", 1)[1].strip()
                host, port = host_port.rsplit(":", 1)
                return process, log, host, int(port)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    log.seek(0)
    process.kill()
    sys.exit("rubato serve did not start:\n" + log.read())


def send(host, port, fixture):
    """Sends the fixture as recorded; returns (status, headers, raw chunks of the body)."""
    connection = http.client.HTTPConnection(host, port, timeout=120)
    body = fixture["body"].encode()
    connection.putrequest(fixture["method"], fixture["path"], skip_host=True,
                          skip_accept_encoding=True)
    for name, value in fixture["headers"]:
        if name.lower() == "host":
            value = f"{host}:{port}"
        elif name.lower() == "content-length":
            value = str(len(body))
        connection.putheader(name, value)
    connection.endheaders(body)
    response = connection.getresponse()
    chunks = []
    while True:
        chunk = response.read1(65536)  # as aiohttp's iter_any: whatever arrived
        if not chunk:
            break
        chunks.append(chunk)
    connection.close()
    return response.status, response.headers, chunks


class StreamedResponseHandler:
    """vLLM's parser of an SSE reply (vllm/benchmarks/lib/endpoint_request_func.py)."""

    def __init__(self):
        self.buffer = ""

    def add_chunk(self, chunk_bytes):
        self.buffer += chunk_bytes.decode("utf-8")
        messages = []
        while "\n\n" in self.buffer:
            message, self.buffer = self.buffer.split("\n\n", 1)
            message = message.strip()
            if message:
                messages.append(message)
        if self.buffer.startswith("data: "):
            content = self.buffer.removeprefix("data: ").strip()
            if content == "[DONE]":
                messages.append(self.buffer.strip())
                self.buffer = ""
            elif content:
                try:
                    json.loads(content)
                    messages.append(self.buffer.strip())
                    self.buffer = ""
                except json.JSONDecodeError:
                    pass
        return messages


def read_like_vllm(chunks, chat):
    """What vllm bench serve's request function makes of the reply."""
    handler = StreamedResponseHandler()
    out = {"first_chunk": False, "text": "", "output_tokens": None, "done": False, "chunks": []}
    for chunk_bytes in chunks:
        chunk_bytes = chunk_bytes.strip()
        if not chunk_bytes:
            continue
        for message in handler.add_chunk(chunk_bytes):
            if message.startswith(":"):
                continue
            chunk = message.removeprefix("data: ")
            if chunk == "[DONE]":
                out["done"] = True
                continue
            data = json.loads(chunk)
            out["chunks"].append(data)
            if choices := data.get("choices"):
                text = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                out["first_chunk"] = True
                out["text"] += text or ""
            elif usage := data.get("usage"):
                out["output_tokens"] = usage.get("completion_tokens")
    return out


def check_logprobs(name, logprobs, chat, top):
    check(isinstance(logprobs, dict), f"{name}: logprobs is an object, not {logprobs!r}")
    if not isinstance(logprobs, dict):
        return 0
    if chat:
        content = logprobs.get("content")
        check(isinstance(content, list), f"{name}: logprobs.content is a list")
        for entry in content or []:
            check(isinstance(entry["token"], str) and entry["logprob"] <= 0 and
                  isinstance(entry["bytes"], list) and len(entry["top_logprobs"]) == top,
                  f"{name}: a logprobs.content entry {entry}")
        return len(content or [])
    tokens = logprobs.get("tokens")
    check(isinstance(tokens, list) and
          len(logprobs["token_logprobs"]) == len(tokens) == len(logprobs["top_logprobs"]) ==
          len(logprobs["text_offset"]), f"{name}: completions logprobs lists of one length")
    for value, alternatives in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        check(value <= 0 and 1 <= len(alternatives) <= top + 1,
              f"{name}: logprob {value}, alternatives {alternatives}")
    return len(tokens or [])


def replay(host, port, path):
    fixture = json.loads(path.read_text())
    name = f"{path.parent.name}/{path.name}"
    body = json.loads(fixture["body"])
    chat = fixture["path"].endswith("chat/completions")
    sent_id = dict((k.lower(), v) for k, v in fixture["headers"]).get("x-request-id")
    status, headers, chunks = send(host, port, fixture)
    raw = b"".join(chunks)
    check(status == 200, f"{name}: status {status}: {raw[:300]!r}")
    if status != 200:
        return
    echoed = headers.get("x-request-id")
    check(bool(echoed) and (sent_id is None or echoed == sent_id),
          f"{name}: x-request-id {echoed!r} (sent {sent_id!r})")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    want_logprobs = body.get("logprobs") not in (None, False)
    top = body.get("top_logprobs", 0) if chat else (body.get("logprobs") or 0)
    if body.get("stream"):
        out = read_like_vllm(chunks, chat)
        check(out["first_chunk"], f"{name}: no chunk with choices (vLLM: a failed request)")
        check(out["done"], f"{name}: no data: [DONE]")
        if (body.get("stream_options") or {}).get("include_usage"):
            last = out["chunks"][-1] if out["chunks"] else {}
            check(last.get("choices") == [] and "usage" in last,
                  f"{name}: the last chunk is the usage chunk: {last}")
            check(isinstance(out["output_tokens"], int) and 0 < out["output_tokens"] <= max_tokens,
                  f"{name}: usage.completion_tokens {out['output_tokens']}")
            if body.get("ignore_eos"):
                check(out["output_tokens"] == max_tokens,
                      f"{name}: ignore_eos gives {out['output_tokens']} tokens, not {max_tokens}")
        expected_id = ("chatcmpl-" if chat else "cmpl-") + echoed
        check(all(c.get("id") == expected_id for c in out["chunks"]),
              f"{name}: chunk ids are {expected_id}")
        if want_logprobs:
            tokens = 0
            for c in out["chunks"]:
                for choice in c.get("choices", []):
                    tokens += check_logprobs(name, choice.get("logprobs"), chat, top)
            check(tokens > 0, f"{name}: no token logprobs in the stream")
        print(f"ok   {name}: {len(out['chunks'])} chunks, {out['output_tokens']} tokens, "
              f"text {out['text'][:40]!r}")
        return
    reply = json.loads(raw)
    choice = reply["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    check(isinstance(text, str), f"{name}: text {text!r}")
    check(reply["usage"]["completion_tokens"] <= max_tokens, f"{name}: usage {reply['usage']}")
    check(reply["id"] == ("chatcmpl-" if chat else "cmpl-") + echoed, f"{name}: id {reply['id']}")
    if want_logprobs:
        tokens = check_logprobs(name, choice.get("logprobs"), chat, top)
        check(0 < tokens <= reply["usage"]["completion_tokens"],
              f"{name}: {tokens} logprobs for {reply['usage']['completion_tokens']} tokens")
    print(f"ok   {name}: {reply['usage']['completion_tokens']} tokens, text {text[:40]!r}")


def check_unauthorized(host, port):
    fixture = json.loads((ROOT / "tests/fixtures/openai_node/node_completions.json").read_text())
    fixture["headers"] = [h for h in fixture["headers"] if h[0].lower() != "authorization"]
    status, headers, chunks = send(host, port, fixture)
    error = json.loads(b"".join(chunks)).get("error", {})
    check(status == 401 and error.get("code") == "invalid_api_key" and "message" in error,
          f"no key: {status} {error}")
    check(bool(headers.get("x-request-id")), "no key: the 401 has an x-request-id")
    fixture["headers"].append(["Authorization", "Bearer wrong"])
    status, _, _ = send(host, port, fixture)
    check(status == 401, f"a wrong key: {status}")
    connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.request("GET", "/health")
    check(connection.getresponse().status == 200, "/health stays open without the key")
    print("ok   API key: 401 without it or with a wrong one, /health open")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tests/client_replay/replay.py PATH/TO/rubato")
    process, log, host, port = start_server(sys.argv[1])
    try:
        fixtures = sorted((ROOT / "tests/fixtures/vllm_bench_serve").glob("*.json")) + \
            sorted((ROOT / "tests/fixtures/openai_node").glob("*.json"))
        check(len(fixtures) >= 9, f"{len(fixtures)} fixtures found")
        for path in fixtures:
            replay(host, port, path)
        check_unauthorized(host, port)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    if FAILURES:
        log.seek(0)
        print("rubato serve's log:\n" + log.read()[-4000:])
        sys.exit(f"client replay: {len(FAILURES)} checks failed")
    print("client replay: all passed")


if __name__ == "__main__":
    main()
