// `rubato bench serve` against fake servers on 127.0.0.1 (one thread, one connection at a time,
// a scripted reply each): valid streams cut at every byte across HTTP chunks and TCP writes,
// HTTP/1.0 replies ended by the close, unexpected JSON, an endless reply, a silent and a
// trickling server (the deadlines), an unwritable result file, strict flags, vLLM's result keys
// and the chat backend's requests.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/test_temp_dir.h"
#include "tests/cli_runner.h"

namespace rubato {
namespace {

using nlohmann::json;

// Serves connections one after another; `reply(fd, index, request)` writes the reply of the
// index-th connection (request: its header and body as read).
class FakeServer {
 public:
  using Reply = std::function<void(int fd, int index, const std::string& request)>;

  explicit FakeServer(Reply reply) : reply_(std::move(reply)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
        ::listen(listener_, 1024) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      ADD_FAILURE() << "fake server: cannot listen";
      return;
    }
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    ::close(listener_);
  }

  int port() const { return port_; }
  std::vector<std::string> requests() {
    std::lock_guard<std::mutex> lock(mutex_);
    return requests_;
  }

 private:
  void Serve() {
    for (int index = 0; !stop_;) {
      pollfd ready{listener_, POLLIN, 0};
      if (::poll(&ready, 1, 50) <= 0) continue;
      const int fd = ::accept(listener_, nullptr, nullptr);
      if (fd < 0) continue;
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      const std::string request = ReadRequest(fd);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        requests_.push_back(request);
      }
      reply_(fd, index++, request);
      ::close(fd);
    }
  }

  // The header and Content-Length body of one request.
  static std::string ReadRequest(int fd) {
    std::string raw;
    char buffer[4096];
    size_t header_end = std::string::npos;
    size_t length = 0;
    while (true) {
      if (header_end == std::string::npos &&
          (header_end = raw.find("\r\n\r\n")) != std::string::npos) {
        const size_t at = raw.find("Content-Length: ");
        if (at != std::string::npos && at < header_end) length = std::stoul(raw.substr(at + 16));
      }
      if (header_end != std::string::npos && raw.size() >= header_end + 4 + length) return raw;
      const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
      if (n <= 0) return raw;
      raw.append(buffer, static_cast<size_t>(n));
    }
  }

  Reply reply_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mutex_;
  std::vector<std::string> requests_;
};

bool Send(int fd, const std::string& data) {
  for (size_t sent = 0; sent < data.size();) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Blocks until the client closes the connection.
void AwaitClose(int fd) {
  char buffer[256];
  while (::recv(fd, buffer, sizeof(buffer), 0) > 0) {
  }
}

constexpr const char* kEvents =
    "data: {\"choices\":[{\"text\":\"Hel\"}]}\n\n"
    "data: {\"choices\":[{\"text\":\"lo\"}]}\n\n"
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n"
    "data: [DONE]\n\n";

std::string Hex(size_t n) {
  char text[32];
  std::snprintf(text, sizeof(text), "%zx", n);
  return text;
}

// A line of the report: the label left-aligned in 40 columns, then the value.
std::string ReportLine(const std::string& label, int64_t value) {
  return label + std::string(40 - label.size(), ' ') + " " + std::to_string(value);
}

testing::ProcessResult Bench(int port, std::vector<std::string> extra, int timeout_s = 60) {
  std::vector<std::string> args = {"bench",   "serve", "--port",       std::to_string(port),
                                   "--model", "fake",  "--no-progress"};
  args.insert(args.end(), extra.begin(), extra.end());
  return testing::RunProcess(RUBATO_BINARY, args, timeout_s);
}

// Every cut of the event stream, as two HTTP chunks sent in two TCP writes, and as an HTTP/1.0
// reply ended by the close (cut in the same two writes): every request succeeds.
TEST(BenchServeCliTest, StreamsCutAtEveryByteAndHttp10RepliesAreRead) {
  const std::string body = kEvents;
  const int cuts = static_cast<int>(body.size()) + 1;
  FakeServer server([&](int fd, int index, const std::string&) {
    const size_t cut = static_cast<size_t>(index % cuts);
    if (index < cuts) {
      const std::string head =
          "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: "
          "chunked\r\n\r\n";
      std::string first = head, second;
      if (cut > 0) first += Hex(cut) + "\r\n" + body.substr(0, cut) + "\r\n";
      if (cut < body.size()) second = Hex(body.size() - cut) + "\r\n" + body.substr(cut) + "\r\n";
      second += "0\r\n\r\n";
      Send(fd, first);
      Send(fd, second);
    } else {
      const std::string reply = "HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + body;
      const size_t at = reply.size() - body.size() + cut;
      Send(fd, reply.substr(0, at));
      Send(fd, reply.substr(at));
    }
  });
  const testing::ProcessResult run =
      Bench(server.port(), {"--num-prompts", std::to_string(2 * cuts), "--max-concurrency", "1",
                            "--random-input-len", "4", "--random-output-len", "2"});
  ASSERT_FALSE(run.signaled) << run.err;
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_NE(run.out.find(ReportLine("Successful requests:", 2 * cuts)), std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find(ReportLine("Total generated tokens:", 4 * cuts)), std::string::npos)
      << run.out;
}

// JSON of the wrong type in an event fails that request with the reason; the process reports
// and exits 1 (every request failed), it does not abort.
TEST(BenchServeCliTest, UnexpectedJsonFailsTheRequestWithItsReason) {
  FakeServer server([](int fd, int index, const std::string&) {
    const char* events[] = {"data: {\"choices\":[{\"text\":5}]}\n\n", "data: [1,2]\n\n",
                            "data: {\"usage\":{\"completion_tokens\":\"x\"}}\n\n"};
    Send(fd, std::string("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n") + events[index % 3]);
  });
  const testing::ProcessResult run =
      Bench(server.port(), {"--num-prompts", "3", "--max-concurrency", "1"});
  ASSERT_FALSE(run.signaled) << run.err;
  EXPECT_EQ(run.exit_code, 1) << run.out << run.err;
  EXPECT_NE(run.out.find("choices[0].text is not a string"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("not a JSON object"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("usage.completion_tokens"), std::string::npos) << run.out;
  EXPECT_NE(run.err.find("all 3 requests failed"), std::string::npos) << run.err;
}

// An endless reply (events without end, then one endless event) fails its request at the
// bound; the client stops reading, so the server could send little more than the bound plus what
// the sockets' buffers hold.
TEST(BenchServeCliTest, AnEndlessReplyFailsAtTheBound) {
  std::atomic<size_t> sent[2] = {0, 0};
  FakeServer server([&](int fd, int index, const std::string&) {
    Send(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n");
    const std::string piece =
        index == 0 ? "data: {\"choices\":[{\"text\":\"x\"}]}\n\n" : std::string(4096, 'a');
    if (index == 1) Send(fd, "data: ");
    std::string block;
    while (block.size() < 65536) block += piece;
    while (index < 2 && Send(fd, block)) sent[index] += block.size();
  });
  const testing::ProcessResult events =
      Bench(server.port(), {"--num-prompts", "1", "--max-reply-bytes", "1048576"});
  ASSERT_FALSE(events.signaled) << events.err;
  EXPECT_EQ(events.exit_code, 1) << events.out << events.err;
  EXPECT_NE(events.out.find("a reply body larger than 1048576 bytes (--max-reply-bytes)"),
            std::string::npos)
      << events.out;
  // The SSE splitter's own bound (1 MiB an event) ends an endless event first.
  const testing::ProcessResult event =
      Bench(server.port(), {"--num-prompts", "1", "--max-reply-bytes", "8388608"});
  ASSERT_FALSE(event.signaled) << event.err;
  EXPECT_EQ(event.exit_code, 1) << event.out << event.err;
  EXPECT_NE(event.out.find("an SSE event longer than 1048576 bytes"), std::string::npos)
      << event.out;
  for (size_t bytes : {sent[0].load(), sent[1].load()}) EXPECT_LT(bytes, size_t{64} << 20);
}

// A server that never answers, and one that sends a byte every 50 ms forever: each request ends
// at --request-timeout; --run-timeout ends the run.
TEST(BenchServeCliTest, DeadlinesEndSilentAndTricklingReplies) {
  FakeServer server([](int fd, int index, const std::string&) {
    if (index % 2 == 0) return AwaitClose(fd);
    Send(fd, "HTTP/1.1 200 OK\r\n\r\n");
    while (Send(fd, ":")) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  });
  const testing::ProcessResult run = Bench(
      server.port(), {"--num-prompts", "2", "--max-concurrency", "1", "--request-timeout", "1"});
  ASSERT_FALSE(run.signaled) << run.err;
  EXPECT_EQ(run.exit_code, 1) << run.out << run.err;
  EXPECT_NE(run.out.find("Error 1: no complete reply within --request-timeout 1 s"),
            std::string::npos)
      << run.out;
  const testing::ProcessResult whole =
      Bench(server.port(), {"--num-prompts", "3", "--max-concurrency", "1", "--run-timeout", "1"});
  ASSERT_FALSE(whole.signaled) << whole.err;
  EXPECT_EQ(whole.exit_code, 1) << whole.out << whole.err;
  EXPECT_NE(whole.out.find("--run-timeout 1 s) passed before the reply ended"), std::string::npos)
      << whole.out;
  EXPECT_NE(whole.err.find("with 3 requests unfinished"), std::string::npos) << whole.err;
}

// vLLM's flat result keys; the completions body vLLM's random dataset sends; the chat backend on
// /v1/chat/completions; a result file that cannot be written exits 1.
TEST(BenchServeCliTest, ResultKeysBodiesAndResultFile) {
  FakeServer server([](int fd, int, const std::string&) {
    Send(fd, std::string("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n") + kEvents);
  });
  TestTempDir dir("bench_serve_cli");
  const testing::ProcessResult run =
      Bench(server.port(),
            {"--num-prompts", "3", "--random-input-len", "6", "--random-output-len", "2",
             "--ignore-eos", "--request-rate", "inf", "--percentile-metrics", "ttft,tpot,itl,e2el",
             "--metric-percentiles", "50,99.9", "--save-result", "--save-detailed", "--result-dir",
             (dir.path() / "out").string(), "--result-filename", "r.json"});
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
  std::ifstream file(dir.path() / "out" / "r.json");
  const json result = json::parse(file, nullptr, false);
  ASSERT_TRUE(result.is_object());
  for (const char* key : {"date",
                          "backend",
                          "model_id",
                          "num_prompts",
                          "request_rate",
                          "burstiness",
                          "duration",
                          "completed",
                          "failed",
                          "total_input_tokens",
                          "total_output_tokens",
                          "request_throughput",
                          "output_throughput",
                          "total_token_throughput",
                          "input_lens",
                          "output_lens",
                          "ttfts",
                          "itls",
                          "generated_texts",
                          "errors",
                          "mean_ttft_ms",
                          "median_ttft_ms",
                          "std_ttft_ms",
                          "p50_ttft_ms",
                          "p99.9_ttft_ms",
                          "median_tpot_ms",
                          "p99.9_tpot_ms",
                          "mean_itl_ms",
                          "p50_e2el_ms",
                          "max_concurrent_requests"}) {
    EXPECT_TRUE(result.contains(key)) << key;
  }
  EXPECT_EQ(result["completed"], 3);
  EXPECT_EQ(result["request_rate"], "inf");
  EXPECT_EQ(result["total_input_tokens"], 12);  // usage.prompt_tokens, 4 each
  EXPECT_EQ(result["generated_texts"][0], "Hello");
  const json body = json::parse(server.requests()[0].substr(server.requests()[0].find("{")));
  EXPECT_EQ(server.requests()[0].rfind("POST /v1/completions HTTP/1.1", 0), 0u);
  EXPECT_EQ(body["prompt"].size(), 6u);
  EXPECT_EQ(body["max_tokens"], 2);
  EXPECT_EQ(body["ignore_eos"], true);
  EXPECT_EQ(body["stream_options"]["include_usage"], true);

  const testing::ProcessResult chat =
      Bench(server.port(), {"--backend", "openai-chat", "--num-prompts", "1"});
  ASSERT_EQ(chat.exit_code, 1) << chat.out << chat.err;  // the reply is a completions stream
  const std::string request = server.requests().back();
  EXPECT_EQ(request.rfind("POST /v1/chat/completions HTTP/1.1", 0), 0u) << request;
  const json chat_body = json::parse(request.substr(request.find("{")));
  EXPECT_EQ(chat_body["messages"][0]["role"], "user");
  EXPECT_EQ(chat_body["max_completion_tokens"], 128);

  for (const std::string& path :
       {std::string("/dev/full"), (dir.path() / "no/such/r.json").string()}) {
    const testing::ProcessResult unwritable =
        Bench(server.port(), {"--num-prompts", "1", "--result-file", path});
    EXPECT_EQ(unwritable.exit_code, 1) << path << unwritable.err;
    EXPECT_NE(unwritable.err.find("cannot write the result file " + path), std::string::npos)
        << unwritable.err;
  }
}

TEST(BenchServeCliTest, NumericFlagsAreParsedStrictly) {
  const struct {
    std::vector<std::string> args;
    const char* flag;
  } cases[] = {
      {{"--random-input-len", "1099511627776"}, "--random-input-len"},
      {{"--input-len", "12abc"}, "--input-len"},
      {{"--random-output-len", "0"}, "--random-output-len"},
      {{"--request-rate", "nan"}, "--request-rate"},
      {{"--request-rate", "-1"}, "--request-rate"},
      {{"--request-rate", std::string(300, '9')}, "--request-rate"},
      {{"--burstiness", "0"}, "--burstiness"},
      {{"--random-range-ratio", "1"}, "--random-range-ratio"},
      {{"--max-concurrency", "-2"}, "--max-concurrency"},
      {{"--seed", "-1"}, "--seed"},
      {{"--metric-percentiles", "50,101"}, "--metric-percentiles"},
      {{"--percentile-metrics", "ttft,foo"}, "--percentile-metrics"},
      {{"--request-timeout", "inf"}, "--request-timeout"},
      {{"--dataset-name", "sharegpt"}, "--dataset-name"},
  };
  for (const auto& c : cases) {
    const testing::ProcessResult run = Bench(1, c.args, 30);
    EXPECT_EQ(run.exit_code, 2) << c.flag << ": " << run.err;
    EXPECT_NE(run.err.find(c.flag), std::string::npos) << run.err;
    EXPECT_LT(run.err.size(), 200u) << run.err;
  }
}

}  // namespace
}  // namespace rubato
