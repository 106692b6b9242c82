// Integration test of `rubato serve` with a prompt that takes seconds to tokenize, through the
// real binary: the work runs on a request worker, so /health on other connections is answered
// meanwhile, in a small fraction of that time (it used to wait for all of it: bodies were parsed
// and tokenized on the HTTP server's only I/O thread).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "tests/cli_runner.h"
#include "tests/http_test_client.h"
#include "tests/serve_test_server.h"

namespace rubato {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using testing::HttpResponse;

constexpr const char* kModelDir = "models/tiny-qwen3-longctx";
constexpr size_t kPromptBytes = 15'000'000;  // under the 16 MiB body limit with its JSON

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A completion whose prompt is kPromptBytes of varied words and numbers: every piece goes
// through the pre-tokenizer and BPE. Far past the model's context, so refused once tokenized.
std::string HeavyBody() {
  std::string prompt;
  prompt.reserve(kPromptBytes + 64);
  for (int64_t i = 0; prompt.size() < kPromptBytes; ++i) {
    prompt += "Once upon a time " + std::to_string(i * 7919) + " foxes ran, ";
  }
  prompt.resize(kPromptBytes);
  return json({{"prompt", prompt}, {"max_tokens", 1}}).dump();
}

// Sends the heavy request on a connection of its own (timeouts of minutes: a sanitizer build
// tokenizes slowly); `sent` is set once the body is out. Returns the response.
HttpResponse SendHeavy(int port, const std::string& body, std::atomic<bool>* sent) {
  const int fd = testing::Connect(port);
  if (fd < 0) return {};
  timeval timeout{300, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  testing::SendAll(fd,
                   "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   "Connection: close\r\nContent-Length: " +
                       std::to_string(body.size()) + "\r\n\r\n" + body);
  if (sent != nullptr) *sent = true;
  const HttpResponse response = testing::ParseResponse(testing::ReadToEof(fd));
  ::close(fd);
  return response;
}

// Refused for its length after it was tokenized: the message counts its tokens.
void ExpectRefusedForLength(const HttpResponse& response) {
  EXPECT_EQ(response.status, 400) << response.body.substr(0, 300);
  const json error = json::parse(response.body, nullptr, false);
  ASSERT_TRUE(error.is_object() && error.contains("error")) << response.body.substr(0, 300);
  EXPECT_EQ(error["error"]["code"], "context_length_exceeded");
}

TEST(ServeHeavyRequestTest, HealthIsAnsweredWhileAHugePromptIsTokenized) {
  int port = 0;
  std::unique_ptr<testing::BackgroundProcess> server =
      testing::StartServe(RUBATO_BINARY, kModelDir, {}, &port);
  ASSERT_GT(port, 0) << server->Err();
  const std::string body = HeavyBody();

  // Alone first: how long the request takes (reading, parsing, and mostly tokenizing).
  const Clock::time_point alone_start = Clock::now();
  ExpectRefusedForLength(SendHeavy(port, body, nullptr));
  const double alone_s = SecondsSince(alone_start);

  // Again, while another connection asks /health over and over until it is answered.
  std::atomic<bool> sent{false};
  std::atomic<bool> answered{false};
  HttpResponse heavy;
  std::thread client([&] {
    heavy = SendHeavy(port, body, &sent);
    answered = true;
  });
  while (!sent) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  int probes = 0;
  double slowest_s = 0;
  // Every probe begun while the heavy request was unanswered counts, also one it outlasted.
  while (!answered) {
    const Clock::time_point start = Clock::now();
    const HttpResponse health = testing::Request(port, "GET", "/health");
    const double took_s = SecondsSince(start);
    EXPECT_EQ(health.status, 200) << health.body;
    if (health.status != 200) break;
    ++probes;
    slowest_s = std::max(slowest_s, took_s);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  client.join();
  ExpectRefusedForLength(heavy);
  // Not vacuous: the heavy request took long enough for several probes, and each was answered
  // in a small part of that time (before, one waited for nearly all of it). The bound holds on
  // a busy 2-core machine: a probe waits for a CPU, not for the tokenizer.
  std::printf("heavy request alone: %.2f s; %d /health probes meanwhile, slowest %.3f s\n", alone_s,
              probes, slowest_s);
  EXPECT_GE(probes, 3) << "the heavy request took " << alone_s << " s";
  EXPECT_LT(slowest_s, std::min(1.0, alone_s / 4)) << "the heavy request took " << alone_s << " s";
}

}  // namespace
}  // namespace rubato
