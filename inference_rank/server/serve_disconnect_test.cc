// Integration tests of `rubato serve` with clients whose fate must not be lost, through the real
// binary: clients that close right after sending a long request (whole or streamed, many at once
// so that they reach a busy engine) are cancelled, counted in rubato:requests_aborted_total and
// generate next to nothing; a client that sends one byte more and then closes is noticed; a
// client that half-closes after its request (shutdown(SHUT_WR), which HTTP/1.1 allows) gets its
// whole response, pipelined ones included. Bounds are counts, and waits are generous (2 busy
// cores).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/cli_runner.h"
#include "tests/http_test_client.h"
#include "tests/serve_test_server.h"

namespace rubato {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;
using testing::MetricValue;
using testing::ReadToEof;
using testing::Request;
using testing::SendRequest;
using testing::WaitUntil;

constexpr const char* kModelDir = "models/tiny-qwen3-longctx";
constexpr int kMaxTokens = 4000;  // far more than a cancelled request may generate
constexpr int kClients = 8;       // as many as engine.max_batch: each would run to the end

std::string Sample(const std::string& name) { return name + "{model_name=\"tiny-qwen3-longctx\"}"; }

std::string CompletionBody(const std::string& prompt, int max_tokens, bool stream) {
  return json({{"prompt", prompt},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"stream", stream}})
      .dump();
}

class ServeDisconnectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = testing::StartServe(RUBATO_BINARY, kModelDir, {}, &port_);
    ASSERT_GT(port_, 0) << server_->Err();
    before_ = Metrics();
  }

  std::string Metrics() const { return Request(port_, "GET", "/metrics").body; }
  // How much `name` grew since the test began.
  double Delta(const std::string& metrics, const std::string& sample) const {
    return MetricValue(metrics, sample) - std::max(0.0, MetricValue(before_, sample));
  }
  double Successes(const std::string& metrics) const {
    const std::string name = "rubato:request_success_total{model_name=\"tiny-qwen3-longctx\",";
    return Delta(metrics, name + "finished_reason=\"length\"}") +
           Delta(metrics, name + "finished_reason=\"stop\"}");
  }
  // Waits (bounded) until `count` more requests were aborted and nothing runs or waits.
  bool WaitAbortedAndIdle(int count) const {
    return WaitUntil(
        [&] {
          const std::string metrics = Metrics();
          return Delta(metrics, Sample("rubato:requests_aborted_total")) >= count &&
                 MetricValue(metrics, Sample("rubato:num_requests_running")) == 0 &&
                 MetricValue(metrics, Sample("rubato:num_requests_waiting")) == 0;
        },
        milliseconds(20000));
  }
  // kClients clients send a long request at once and close without reading: every one is
  // cancelled, none runs to its end, and the server then serves the next request.
  void ClientsThatCloseAtOnceAreCancelled(bool stream) {
    for (int i = 0; i < kClients; ++i) {
      const int fd = SendRequest(port_, "/v1/completions",
                                 CompletionBody("Client " + std::to_string(i), kMaxTokens, stream));
      ASSERT_GE(fd, 0);
      ::close(fd);
    }
    const bool idle = WaitAbortedAndIdle(kClients);
    const std::string after = Metrics();
    EXPECT_TRUE(idle) << after;
    EXPECT_EQ(Delta(after, Sample("rubato:requests_aborted_total")), kClients);
    EXPECT_EQ(Successes(after), 0);
    EXPECT_LT(Delta(after, Sample("rubato:generation_tokens_total")), kClients * kMaxTokens / 8);
    const testing::HttpResponse next =
        Request(port_, "POST", "/v1/completions", CompletionBody("Hello", 4, stream));
    EXPECT_EQ(next.status, 200) << next.body;
  }

  std::unique_ptr<testing::BackgroundProcess> server_;
  int port_ = 0;
  std::string before_;  // the metrics when the test began
};

TEST_F(ServeDisconnectTest, WholeRequestsOfClientsThatCloseAtOnceAreCancelled) {
  ClientsThatCloseAtOnceAreCancelled(/*stream=*/false);
}

TEST_F(ServeDisconnectTest, StreamedRequestsOfClientsThatCloseAtOnceAreCancelled) {
  ClientsThatCloseAtOnceAreCancelled(/*stream=*/true);
}

// One byte after the request (the start of a next one), sent once the request runs, and a
// close: still a client gone. The same byte from a client that stays cancels nothing.
TEST_F(ServeDisconnectTest, ClientClosingAfterOneMoreByteIsNoticed) {
  const auto wait_running = [&](int count) {
    return WaitUntil(
        [&] { return MetricValue(Metrics(), Sample("rubato:num_requests_running")) == count; },
        milliseconds(20000));
  };
  const int gone =
      SendRequest(port_, "/v1/completions", CompletionBody("Once upon a time", kMaxTokens, false));
  ASSERT_GE(gone, 0);
  ASSERT_TRUE(wait_running(1));
  testing::SendAll(gone, "P");
  ::close(gone);
  EXPECT_TRUE(WaitAbortedAndIdle(1));
  // Long enough to be seen running between two polls of /metrics on a busy machine (6 tokens
  // were once over before the next poll).
  const int stays = SendRequest(port_, "/v1/completions", CompletionBody("Hello", 64, false),
                                "Connection: close\r\n");
  ASSERT_GE(stays, 0);
  ASSERT_TRUE(wait_running(1));
  testing::SendAll(stays, "P");
  const testing::HttpResponse answered = testing::ParseResponse(ReadToEof(stays));
  ::close(stays);
  EXPECT_EQ(answered.status, 200) << answered.body;
  const std::string after = Metrics();
  EXPECT_EQ(Delta(after, Sample("rubato:requests_aborted_total")), 1);
  EXPECT_EQ(Successes(after), 1);
  EXPECT_LT(Delta(after, Sample("rubato:generation_tokens_total")), kMaxTokens / 4);
}

// shutdown(SHUT_WR) after a complete request ends the client's input, not its interest: it gets
// the text a client that stays gets.
TEST_F(ServeDisconnectTest, HalfClosedClientsGetTheirWholeResponse) {
  const testing::HttpResponse normal =
      Request(port_, "POST", "/v1/completions", CompletionBody("Once upon a time", 24, false));
  ASSERT_EQ(normal.status, 200) << normal.body;
  const std::string expected = json::parse(normal.body)["choices"][0]["text"];
  for (const bool stream : {false, true}) {
    const int fd =
        SendRequest(port_, "/v1/completions", CompletionBody("Once upon a time", 24, stream));
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::shutdown(fd, SHUT_WR), 0);
    const testing::HttpResponse response = testing::ParseResponse(ReadToEof(fd));
    ::close(fd);
    ASSERT_EQ(response.status, 200) << "stream " << stream << ": " << response.body;
    if (!stream) {
      EXPECT_EQ(json::parse(response.body)["choices"][0]["text"], expected);
      continue;
    }
    const std::vector<std::string> events = testing::SseData(response.body);
    ASSERT_GE(events.size(), 2u) << response.body;
    EXPECT_EQ(events.back(), "[DONE]");
    std::string text;
    for (size_t i = 0; i + 1 < events.size(); ++i) {
      text += json::parse(events[i])["choices"][0]["text"].get<std::string>();
    }
    EXPECT_EQ(text, expected);
  }
  // Two pipelined requests, then the half-close: both are answered.
  const std::string second = CompletionBody("Hello", 3, false);
  const int fd = SendRequest(port_, "/v1/completions", CompletionBody("Hi", 5, false), "",
                             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                                 std::to_string(second.size()) + "\r\n\r\n" + second);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::shutdown(fd, SHUT_WR), 0);
  const std::string raw = ReadToEof(fd);
  ::close(fd);
  const size_t first_reply = raw.find("HTTP/1.1 200 ");
  ASSERT_NE(first_reply, std::string::npos) << raw;
  EXPECT_NE(raw.find("HTTP/1.1 200 ", first_reply + 1), std::string::npos) << raw;
  EXPECT_EQ(Delta(Metrics(), Sample("rubato:requests_aborted_total")), 0);
}

}  // namespace
}  // namespace rubato
