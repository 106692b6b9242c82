// `rubato serve --cache` against a cache rank that dies and comes back, as a user runs it: two
// processes, KV over UCX (TCP), heartbeats every 100 ms. A request streaming when the cache rank
// is killed ends with one error event naming it, then [DONE]; /health answers 503 while it is
// gone and a new request fails with 503; once a cache rank listens on the same endpoint again the
// server reconnects by itself, /health answers 200 and requests succeed. A request past the
// cache rank's budget fails alone (507) with /health still 200. Every wait is bounded.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
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
using testing::Connect;
using testing::HttpResponse;
using testing::ParseResponse;
using testing::ReadToEof;
using testing::Request;
using testing::SendAll;
using testing::StartServe;

constexpr const char* kModel = "models/tiny-qwen3-longctx";

std::string CompletionBody(int max_tokens, bool stream) {
  return json({{"prompt", "Once upon a time"},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"stream", stream}})
      .dump();
}

// Polls /health until it answers `status` (true) or `timeout` passes (false).
bool WaitForHealth(int port, int status, milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (Request(port, "GET", "/health").status == status) return true;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return false;
}

class ServeReconnectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);  // the transport that notices a dead peer
    config_ = (dir_.path() / "fast_heartbeat.yaml").string();
    std::ofstream(config_) << "limits:\n  heartbeat_ms: 100\n  rpc_timeout_ms: 2000\n";
  }

  // A cache rank on `listen` (more flags in `args`), once it prints its endpoint (into
  // endpoint_).
  std::unique_ptr<BackgroundProcess> StartCache(const std::string& listen,
                                                const std::vector<std::string>& args = {}) {
    std::vector<std::string> argv = {"cache", "--listen", listen, "--config", config_};
    argv.insert(argv.end(), args.begin(), args.end());
    auto cache = std::make_unique<BackgroundProcess>(RUBATO_BINARY, argv);
    EXPECT_TRUE(cache->WaitForOutput("listening on", milliseconds(20000))) << cache->Err();
    std::smatch match;
    const std::string out = cache->Out();
    if (std::regex_search(out, match, std::regex("listening on (\\S+)"))) endpoint_ = match[1];
    return cache;
  }

  TestTempDir dir_{"serve_reconnect"};
  std::string config_;
  std::string endpoint_;
};

TEST_F(ServeReconnectTest, ALostCacheRankFailsItsRequestsAndARestartedOneServesAgain) {
  std::unique_ptr<BackgroundProcess> cache = StartCache("127.0.0.1:0");
  ASSERT_FALSE(endpoint_.empty());
  const std::string endpoint = endpoint_;
  int port = 0;
  const std::unique_ptr<BackgroundProcess> server_process =
      StartServe(RUBATO_BINARY, kModel,
                 {"--policy", "offload_dense", "--cache", endpoint, "--config", config_}, &port);
  BackgroundProcess& server = *server_process;
  ASSERT_GT(port, 0) << server.Out() << server.Err();
  ASSERT_EQ(Request(port, "GET", "/health").status, 200);
  ASSERT_EQ(Request(port, "POST", "/v1/completions", CompletionBody(4, false)).status, 200);

  // A long stream runs when the cache rank dies: it ends with one error event naming it, then
  // [DONE].
  const int stream = Connect(port);
  ASSERT_GE(stream, 0);
  const std::string body = CompletionBody(4000, true);
  SendAll(stream, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                      std::to_string(body.size()) + "\r\n\r\n" + body);
  char first[256];
  const ssize_t received = ::recv(stream, first, sizeof(first), 0);
  ASSERT_GT(received, 0);  // the stream has started
  cache->Signal(SIGKILL);
  const HttpResponse streamed =
      ParseResponse(std::string(first, static_cast<size_t>(received)) + ReadToEof(stream));
  ::close(stream);
  size_t errors = 0;
  for (size_t at = streamed.body.find("\"error\""); at != std::string::npos;
       at = streamed.body.find("\"error\"", at + 1)) {
    ++errors;
  }
  EXPECT_EQ(errors, 1u) << streamed.body;
  EXPECT_NE(streamed.body.find("cache rank " + endpoint), std::string::npos) << streamed.body;
  EXPECT_EQ(streamed.body.substr(streamed.body.rfind("data: ")), "data: [DONE]\n\n");
  EXPECT_LT(streamed.body.rfind("\"error\""), streamed.body.rfind("data: [DONE]"));

  // Gone: /health says so, and a new request fails with 503.
  EXPECT_TRUE(WaitForHealth(port, 503, milliseconds(10000)));
  const HttpResponse refused = Request(port, "POST", "/v1/completions", CompletionBody(4, false));
  EXPECT_EQ(refused.status, 503) << refused.body;
  EXPECT_NE(refused.body.find("cache rank"), std::string::npos) << refused.body;
  EXPECT_TRUE(cache->Wait(milliseconds(5000)).signaled);

  // Back on the same endpoint: the server reconnects by itself (backoff up to 10 s).
  std::unique_ptr<BackgroundProcess> restarted = StartCache(endpoint);
  ASSERT_EQ(endpoint_, endpoint) << restarted->Err();
  EXPECT_TRUE(WaitForHealth(port, 200, milliseconds(30000))) << server.Err();
  const HttpResponse again = Request(port, "POST", "/v1/completions", CompletionBody(4, false));
  EXPECT_EQ(again.status, 200) << again.body;
  const std::string metrics = Request(port, "GET", "/metrics").body;
  EXPECT_NE(metrics.find("\nrubato:cache_link_up 1\n"), std::string::npos) << metrics;
  EXPECT_NE(server.Err().find("reconnected to cache rank " + endpoint), std::string::npos)
      << server.Err();

  server.Signal(SIGTERM);
  EXPECT_EQ(server.Wait(milliseconds(15000)).exit_code, 0);
  restarted->Signal(SIGTERM);
  EXPECT_EQ(restarted->Wait(milliseconds(10000)).exit_code, 0);
}

// A request whose KV does not fit the cache rank's budget fails alone with 507, and /health
// stays 200 for everyone (it used to turn 503 until a later request succeeded); a request that
// fits is served right after.
TEST_F(ServeReconnectTest, ARequestPastTheCacheBudgetFailsAloneWith507) {
  std::unique_ptr<BackgroundProcess> cache = StartCache("127.0.0.1:0", {"--budget-mb", "1"});
  ASSERT_FALSE(endpoint_.empty());
  int port = 0;
  const std::unique_ptr<BackgroundProcess> server_process =
      StartServe(RUBATO_BINARY, kModel,
                 {"--policy", "offload_dense", "--cache", endpoint_, "--config", config_}, &port);
  BackgroundProcess& server = *server_process;
  ASSERT_GT(port, 0) << server.Out() << server.Err();

  // 3000 new tokens of the tiny model need ~9 MB of KV: past the 1 MiB budget.
  const HttpResponse big = Request(port, "POST", "/v1/completions", CompletionBody(3000, false));
  EXPECT_EQ(big.status, 507) << big.body;
  EXPECT_NE(big.body.find("kv_budget_exhausted"), std::string::npos) << big.body;
  EXPECT_EQ(Request(port, "GET", "/health").status, 200);
  EXPECT_EQ(Request(port, "POST", "/v1/completions", CompletionBody(4, false)).status, 200);
  EXPECT_EQ(Request(port, "GET", "/health").status, 200);

  server.Signal(SIGTERM);
  EXPECT_EQ(server.Wait(milliseconds(15000)).exit_code, 0);
  cache->Signal(SIGTERM);
  EXPECT_EQ(cache->Wait(milliseconds(10000)).exit_code, 0);
}

}  // namespace
}  // namespace rubato
