// Integration tests of `rubato serve`'s graceful stop, through the real binary: after SIGTERM
// new connections are refused, a request already being sent gets 503 (and /health 503), requests
// in flight finish normally within server.shutdown_grace_s, and those still running when it ends
// get an explicit error: a 503 JSON body, or an SSE error event followed by `data: [DONE]`. A
// second signal ends the grace at once. The server exits with code 0 in every case.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "tests/cli_runner.h"
#include "tests/http_test_client.h"
#include "tests/serve_test_server.h"

namespace rubato {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;
using testing::BackgroundProcess;
using testing::HttpResponse;
using testing::MetricValue;
using testing::ParseResponse;
using testing::ReadToEof;
using testing::Request;
using testing::SendRequest;
using testing::SseData;
using testing::WaitUntil;

constexpr const char* kModelDir = "models/tiny-qwen3-longctx";
constexpr int kLongTokens = 7000;  // runs for many seconds on the tiny model
constexpr int kShortTokens = 150;  // a fraction of a second to seconds (a busy machine)

std::string CompletionBody(int max_tokens, bool stream) {
  return json({{"prompt", "Once upon a time"},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"stream", stream}})
      .dump();
}

// Waits (bounded) until the server runs `count` requests.
bool WaitRunning(int port, int count) {
  return WaitUntil(
      [&] {
        return MetricValue(Request(port, "GET", "/metrics").body,
                           "rubato:num_requests_running{model_name=\"tiny-qwen3-longctx\"}") ==
               count;
      },
      milliseconds(20000));
}

// A streamed request whose first event has arrived: the socket, and the bytes read so far.
struct OpenStream {
  int fd = -1;
  std::string head;
};
OpenStream StartStream(int port, int max_tokens) {
  OpenStream stream;
  stream.fd = SendRequest(port, "/v1/completions", CompletionBody(max_tokens, true));
  char buffer[4096];
  while (stream.fd >= 0 && stream.head.find("data: ") == std::string::npos) {
    const ssize_t n = ::recv(stream.fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    stream.head.append(buffer, static_cast<size_t>(n));
  }
  return stream;
}

// The rest of a stream, de-chunked, with the head read before.
HttpResponse FinishStream(OpenStream& stream) {
  const HttpResponse response = ParseResponse(stream.head + ReadToEof(stream.fd));
  ::close(stream.fd);
  stream.fd = -1;
  return response;
}

// A connection on which one GET /health was answered and that is kept alive; -1 on failure.
int KeptAliveConnection(int port) {
  const int fd = testing::Connect(port);
  if (fd < 0) return -1;
  testing::SendAll(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string reply;
  char buffer[1024];
  // The reply is "ok" after its head: read until both came.
  while (reply.find("\r\n\r\nok") == std::string::npos) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) {
      ::close(fd);
      return -1;
    }
    reply.append(buffer, static_cast<size_t>(n));
  }
  return fd;
}

void ExpectExitCodeZero(BackgroundProcess& server) {
  const testing::ProcessResult result = server.Wait(milliseconds(20000));
  EXPECT_FALSE(result.signaled) << "signal " << result.signal << ": " << result.err;
  EXPECT_EQ(result.exit_code, 0) << result.err;
}

// Requests in flight at SIGTERM that end within the grace period end as usual, and the server
// exits as soon as they did (long before the 60 s grace).
TEST(ServeShutdownTest, RequestsInFlightFinishNormally) {
  int port = 0;
  std::unique_ptr<BackgroundProcess> server =
      testing::StartServe(RUBATO_BINARY, kModelDir, {"--shutdown-grace-s", "60"}, &port);
  ASSERT_GT(port, 0) << server->Err();
  const int whole = SendRequest(port, "/v1/completions", CompletionBody(kShortTokens, false));
  ASSERT_GE(whole, 0);
  OpenStream stream = StartStream(port, kShortTokens);
  ASSERT_GE(stream.fd, 0);
  ASSERT_TRUE(WaitRunning(port, 2));
  server->Signal(SIGTERM);
  const HttpResponse reply = ParseResponse(ReadToEof(whole));
  ::close(whole);
  ASSERT_EQ(reply.status, 200) << reply.body;
  EXPECT_EQ(json::parse(reply.body)["usage"]["completion_tokens"], kShortTokens);
  const HttpResponse streamed = FinishStream(stream);
  const std::vector<std::string> events = SseData(streamed.body);
  ASSERT_GE(events.size(), 2u) << streamed.body;
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(json::parse(events[events.size() - 2])["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(streamed.body.find("\"error\""), std::string::npos) << streamed.body;
  ExpectExitCodeZero(*server);
}

// Past the grace period (1 s from the config) requests still running end with an explicit
// error. Meanwhile new connections are refused, and a request that was being sent gets 503.
TEST(ServeShutdownTest, RequestsPastTheGraceEndWithAnExplicitError) {
  TestTempDir dir("serve_shutdown");
  const std::string config =
      dir.WriteFile("rubato.yaml", "server:\n  shutdown_grace_s: 1\n").string();
  int port = 0;
  std::unique_ptr<BackgroundProcess> server =
      testing::StartServe(RUBATO_BINARY, kModelDir, {"--config", config}, &port);
  ASSERT_GT(port, 0) << server->Err();
  const int whole = SendRequest(port, "/v1/completions", CompletionBody(kLongTokens, false));
  ASSERT_GE(whole, 0);
  OpenStream stream = StartStream(port, kLongTokens);
  ASSERT_GE(stream.fd, 0);
  ASSERT_TRUE(WaitRunning(port, 2));
  // Requests half sent when the signal comes, on connections the server has served already (so
  // it has accepted them).
  const int health = KeptAliveConnection(port);
  const int completion = KeptAliveConnection(port);
  ASSERT_GE(health, 0);
  ASSERT_GE(completion, 0);
  testing::SendAll(health, "GET /health HTTP/1.1\r\nHost: x\r\n");
  const std::string body = CompletionBody(4, false);
  testing::SendAll(completion, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                                   std::to_string(body.size()) + "\r\n\r\n{");
  server->Signal(SIGTERM);
  EXPECT_TRUE(server->WaitForOutput("draining", milliseconds(10000))) << server->Out();
  EXPECT_EQ(testing::Connect(port), -1) << "a new connection was accepted while draining";
  testing::SendAll(health, "\r\n");
  testing::SendAll(completion, body.substr(1));
  for (const int fd : {health, completion}) {
    const HttpResponse refused = ParseResponse(ReadToEof(fd));
    ::close(fd);
    EXPECT_EQ(refused.status, 503) << refused.body;
    const auto connection = refused.headers.find("connection");
    EXPECT_TRUE(connection != refused.headers.end() && connection->second == "close");
  }

  const HttpResponse reply = ParseResponse(ReadToEof(whole));
  ::close(whole);
  EXPECT_EQ(reply.status, 503) << reply.body;
  const json error = json::parse(reply.body, nullptr, false);
  ASSERT_TRUE(error.is_object() && error.contains("error")) << reply.body;
  EXPECT_NE(error["error"]["message"].get<std::string>().find("server.shutdown_grace_s"),
            std::string::npos)
      << reply.body;
  const HttpResponse streamed = FinishStream(stream);
  EXPECT_EQ(streamed.status, 200);
  const std::vector<std::string> events = SseData(streamed.body);
  ASSERT_GE(events.size(), 3u) << streamed.body;
  EXPECT_EQ(events.back(), "[DONE]");
  const json event = json::parse(events[events.size() - 2], nullptr, false);
  ASSERT_TRUE(event.is_object() && event.contains("error")) << streamed.body;
  EXPECT_EQ(event["error"]["type"], "service_unavailable_error");
  ExpectExitCodeZero(*server);
}

// A second signal (an impatient operator) ends the grace period at once: the request gets its
// error within seconds of a 60 s grace.
TEST(ServeShutdownTest, SecondSignalEndsTheGraceAtOnce) {
  int port = 0;
  std::unique_ptr<BackgroundProcess> server =
      testing::StartServe(RUBATO_BINARY, kModelDir, {"--shutdown-grace-s", "60"}, &port);
  ASSERT_GT(port, 0) << server->Err();
  OpenStream stream = StartStream(port, kLongTokens);
  ASSERT_GE(stream.fd, 0);
  server->Signal(SIGINT);
  EXPECT_TRUE(server->WaitForOutput("draining", milliseconds(10000))) << server->Out();
  server->Signal(SIGINT);
  const HttpResponse streamed = FinishStream(stream);
  const std::vector<std::string> events = SseData(streamed.body);
  ASSERT_GE(events.size(), 2u) << streamed.body;
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_NE(events[events.size() - 2].find("\"error\""), std::string::npos) << streamed.body;
  ExpectExitCodeZero(*server);
}

TEST(ServeShutdownTest, BadGraceIsRefusedByName) {
  const testing::ProcessResult negative = testing::RunProcess(
      RUBATO_BINARY, {"serve", "--model", kModelDir, "--port", "0", "--shutdown-grace-s", "99999"},
      30);
  EXPECT_EQ(negative.exit_code, 2) << negative.err;
  EXPECT_NE(negative.err.find("--shutdown-grace-s"), std::string::npos) << negative.err;
}

}  // namespace
}  // namespace rubato
