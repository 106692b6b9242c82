// Several cache ranks behind one `rubato serve --cache A,B,C`, as a user runs them: three
// `rubato cache --listen 127.0.0.1:0` processes, KV over UCX (TCP), heartbeats every 100 ms.
// Requests are placed by free budget (each cache rank's sessions, read from its /metrics); one
// of three cache ranks killed mid-run fails only the request whose KV lives there, with an
// error naming that rank, while the others finish with the tokens of a colocated dense run; the
// restarted rank is reconnected and takes new requests; `rubato generate --cache A,B,C` gives
// the colocated dense text. Every wait is bounded.
// Narrative: docs/disaggregated.md "Several cache ranks".
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
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
using testing::MetricValue;
using testing::Request;

constexpr const char* kModel = "models/tiny-qwen3-longctx";

std::string CompletionBody(int max_tokens, bool stream) {
  return json({{"prompt", "Once upon a time"},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"stream", stream}})
      .dump();
}

// A cache rank process, its RPC endpoint and its metrics port.
struct CacheRank {
  std::unique_ptr<BackgroundProcess> process;
  std::string endpoint;
  int metrics_port = 0;
};

// A streaming completion whose first bytes have arrived (the request holds its session).
struct OpenStream {
  int fd = -1;
  std::string first;
};

OpenStream StartStream(int port, int max_tokens) {
  OpenStream stream;
  stream.fd = testing::Connect(port);
  if (stream.fd < 0) return stream;
  const std::string body = CompletionBody(max_tokens, true);
  testing::SendAll(
      stream.fd,
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body);
  char first[256];
  const ssize_t received = ::recv(stream.fd, first, sizeof(first), 0);
  if (received > 0) stream.first.assign(first, static_cast<size_t>(received));
  return stream;
}

// The text a stream carried and its error events' payloads.
struct StreamResult {
  std::string text;
  std::vector<std::string> errors;
  bool done = false;  // ended with [DONE]
};

StreamResult FinishStream(OpenStream& stream) {
  const testing::HttpResponse response =
      testing::ParseResponse(stream.first + testing::ReadToEof(stream.fd));
  ::close(stream.fd);
  StreamResult result;
  for (const std::string& data : testing::SseData(response.body)) {
    if (data == "[DONE]") {
      result.done = true;
      continue;
    }
    const json event = json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (event.contains("error")) {
      result.errors.push_back(data);
    } else if (event.contains("choices") && !event["choices"].empty()) {
      result.text += event["choices"][0].value("text", "");
    }
  }
  return result;
}

class MultiCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);  // the transport that notices a dead peer
    config_ = (dir_.path() / "fast_heartbeat.yaml").string();
    std::ofstream(config_) << "limits:\n  heartbeat_ms: 100\n  rpc_timeout_ms: 2000\n";
  }

  // A cache rank on `listen` with a budget of `budget_mb` MiB and a metrics endpoint.
  CacheRank StartCache(const std::string& listen, int budget_mb) {
    CacheRank rank;
    rank.process = std::make_unique<BackgroundProcess>(
        RUBATO_BINARY,
        std::vector<std::string>{"cache", "--listen", listen, "--config", config_, "--budget-mb",
                                 std::to_string(budget_mb), "--metrics", "127.0.0.1:0"});
    for (const char* line : {"listening on", "/metrics"}) {
      EXPECT_TRUE(rank.process->WaitForOutput(line, milliseconds(20000)))
          << rank.process->Out() << rank.process->Err();
    }
    const std::string out = rank.process->Out();
    std::smatch match;
    if (std::regex_search(out, match, std::regex("listening on (\\S+)"))) rank.endpoint = match[1];
    if (std::regex_search(out, match, std::regex("metrics on http://[0-9.]+:(\\d+)/metrics"))) {
      rank.metrics_port = std::stoi(match[1]);
    }
    return rank;
  }

  static double Sessions(const CacheRank& rank) {
    return MetricValue(Request(rank.metrics_port, "GET", "/metrics").body,
                       "rubato:cache_rank_sessions");
  }

  static void Stop(BackgroundProcess& process) {
    process.Signal(SIGTERM);
    EXPECT_EQ(process.Wait(milliseconds(15000)).exit_code, 0) << process.Err();
  }

  std::unique_ptr<BackgroundProcess> StartServer(const std::vector<CacheRank>& ranks, int* port) {
    std::string endpoints;
    for (const CacheRank& rank : ranks) endpoints += (endpoints.empty() ? "" : ",") + rank.endpoint;
    return testing::StartServe(
        RUBATO_BINARY, kModel,
        {"--policy", "offload_dense", "--cache", endpoints, "--config", config_}, port);
  }

  TestTempDir dir_{"multi_cache"};
  std::string config_;
};

// Budgets of 8, 20 and 15 MiB; each request of 2000 tokens reserves ~5.9 MiB (3 KiB a
// position of the tiny model). The first goes to the 20 (then 14.1 free), the second to the 15
// (more than 14.1), the third to the 20 again: sessions 0, 2, 1.
TEST_F(MultiCacheTest, RequestsArePlacedOnTheCacheRankWithTheMostFreeBudget) {
  std::vector<CacheRank> ranks;
  for (const int budget : {8, 20, 15}) ranks.push_back(StartCache("127.0.0.1:0", budget));
  for (const CacheRank& rank : ranks) ASSERT_GT(rank.metrics_port, 0);
  int port = 0;
  const std::unique_ptr<BackgroundProcess> server = StartServer(ranks, &port);
  ASSERT_GT(port, 0) << server->Out() << server->Err();

  std::vector<OpenStream> streams;
  for (int i = 0; i < 3; ++i) {
    streams.push_back(StartStream(port, 2000));
    ASSERT_FALSE(streams.back().first.empty()) << "stream " << i << "\n" << server->Err();
  }
  EXPECT_EQ(Sessions(ranks[0]), 0);
  EXPECT_EQ(Sessions(ranks[1]), 2);
  EXPECT_EQ(Sessions(ranks[2]), 1);

  // Closing the streams cancels the requests and closes their sessions.
  for (OpenStream& stream : streams) ::close(stream.fd);
  EXPECT_TRUE(testing::WaitUntil([&] { return Sessions(ranks[1]) == 0 && Sessions(ranks[2]) == 0; },
                                 milliseconds(20000)));
  Stop(*server);

  // `rubato generate --cache A,B,C` (or topology.cache_endpoints) gives the colocated dense
  // text.
  const std::vector<std::string> generate = {"generate", "--model",          kModel,
                                             "--prompt", "Once upon a time", "--max-tokens",
                                             "24",       "--threads",        "1"};
  std::vector<std::string> dense_args = generate;
  dense_args.insert(dense_args.end(), {"--policy", "dense"});
  const testing::ProcessResult dense = testing::RunProcess(RUBATO_BINARY, dense_args);
  ASSERT_EQ(dense.exit_code, 0) << dense.err;
  std::vector<std::string> offloaded_args = generate;
  offloaded_args.insert(offloaded_args.end(),
                        {"--policy", "offload_dense", "--config", config_, "--cache",
                         ranks[0].endpoint + "," + ranks[1].endpoint + "," + ranks[2].endpoint});
  const testing::ProcessResult offloaded = testing::RunProcess(RUBATO_BINARY, offloaded_args);
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.err;
  // The same list as topology.cache_endpoints of a config file.
  const std::string listed = (dir_.path() / "three_cache_ranks.yaml").string();
  std::ofstream(listed) << "limits:\n  heartbeat_ms: 100\n  rpc_timeout_ms: 2000\n"
                        << "engine:\n  kv_residency: offloaded\n"
                        << "topology:\n  mode: disaggregated\n  transport: ucx\n"
                        << "  cache_endpoints: [" << ranks[0].endpoint << ", " << ranks[1].endpoint
                        << ", " << ranks[2].endpoint << "]\n";
  std::vector<std::string> config_args = generate;
  config_args.insert(config_args.end(), {"--config", listed});
  const testing::ProcessResult configured = testing::RunProcess(RUBATO_BINARY, config_args);
  ASSERT_EQ(configured.exit_code, 0) << configured.err;
  const auto text = [](const std::string& out) { return out.substr(0, out.rfind("\n[rubato]")); };
  EXPECT_EQ(text(offloaded.out), text(dense.out));
  EXPECT_EQ(text(configured.out), text(dense.out));
  EXPECT_NE(offloaded.out.find("offload_bytes_sent="), std::string::npos) << offloaded.out;
  EXPECT_EQ(offloaded.out.find("offload_bytes_sent=0 "), std::string::npos) << offloaded.out;
  for (CacheRank& rank : ranks) Stop(*rank.process);
}

TEST_F(MultiCacheTest, ALostCacheRankFailsOnlyItsRequestsAndARestartedOneTakesNewOnes) {
  constexpr int kTokens = 600;
  // The colocated dense text of the request the surviving ranks serve.
  std::string dense;
  {
    int port = 0;
    const std::unique_ptr<BackgroundProcess> colocated =
        testing::StartServe(RUBATO_BINARY, kModel, {"--policy", "dense"}, &port);
    ASSERT_GT(port, 0) << colocated->Err();
    const testing::HttpResponse reply =
        Request(port, "POST", "/v1/completions", CompletionBody(kTokens, false));
    ASSERT_EQ(reply.status, 200) << reply.body;
    dense = json::parse(reply.body)["choices"][0]["text"];
    ASSERT_FALSE(dense.empty());
    Stop(*colocated);
  }

  // Budgets of 64, 70 and 64 MiB. The long request (~11.7 MiB) opens first, on rank 1 (then
  // ~58 free), and cannot end before the kill; the two short ones (~1.8 MiB) go to rank 0, then
  // rank 2 (or rank 0 again if the first has already ended: either way not rank 1).
  std::vector<CacheRank> ranks;
  for (const int budget : {64, 70, 64}) ranks.push_back(StartCache("127.0.0.1:0", budget));
  int port = 0;
  const std::unique_ptr<BackgroundProcess> server = StartServer(ranks, &port);
  ASSERT_GT(port, 0) << server->Out() << server->Err();
  OpenStream on_rank1 = StartStream(port, 4000);  // far longer than the test waits
  OpenStream on_rank0 = StartStream(port, kTokens);
  OpenStream on_rank2 = StartStream(port, kTokens);
  ASSERT_FALSE(on_rank0.first.empty() || on_rank1.first.empty() || on_rank2.first.empty())
      << server->Err();
  ASSERT_EQ(Sessions(ranks[1]), 1);

  ranks[1].process->Signal(SIGKILL);
  const StreamResult lost = FinishStream(on_rank1);
  ASSERT_EQ(lost.errors.size(), 1u) << lost.text;
  EXPECT_NE(lost.errors[0].find("cache rank 1 of 3 (" + ranks[1].endpoint + ")"), std::string::npos)
      << lost.errors[0];
  EXPECT_TRUE(lost.done);
  EXPECT_TRUE(ranks[1].process->Wait(milliseconds(5000)).signaled);
  // Two ranks still serve: the server stays healthy.
  EXPECT_EQ(Request(port, "GET", "/health").status, 200);
  const std::string metrics = Request(port, "GET", "/metrics").body;
  EXPECT_NE(metrics.find("\nrubato:cache_link_up 1\n"), std::string::npos) << metrics;

  // Restarted on the same endpoint, with a larger budget, while the others still run: once
  // reconnected it takes the next request (the most free budget).
  const std::string endpoint = ranks[1].endpoint;
  ranks[1] = StartCache(endpoint, 128);
  ASSERT_EQ(ranks[1].endpoint, endpoint);
  for (OpenStream* stream : {&on_rank0, &on_rank2}) {
    const StreamResult served = FinishStream(*stream);
    EXPECT_TRUE(served.errors.empty()) << served.errors[0];
    EXPECT_TRUE(served.done);
    EXPECT_EQ(served.text, dense);
  }
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        return server->Err().find("reconnected to cache rank " + endpoint) != std::string::npos;
      },
      milliseconds(30000)))
      << server->Err();
  OpenStream next = StartStream(port, 2000);
  ASSERT_FALSE(next.first.empty()) << server->Err();
  EXPECT_EQ(Sessions(ranks[1]), 1);
  ::close(next.fd);

  Stop(*server);
  for (CacheRank& rank : ranks) Stop(*rank.process);
}

// Pods that start together (the Helm chart lists every cache replica): a cache rank that is not
// up when the inference rank starts is connected in the background and then takes requests;
// with none up, the inference rank refuses to start, naming each.
TEST_F(MultiCacheTest, ACacheRankNotUpAtStartIsConnectedWhenItComesUp) {
  const int late_port = testing::FreePort();
  ASSERT_GT(late_port, 0);
  const std::string late = "127.0.0.1:" + std::to_string(late_port);
  std::vector<CacheRank> ranks(2);
  ranks[0] = StartCache("127.0.0.1:0", 16);
  ranks[1].endpoint = late;  // no process yet
  int port = 0;
  const std::unique_ptr<BackgroundProcess> server = StartServer(ranks, &port);
  ASSERT_GT(port, 0) << server->Out() << server->Err();
  EXPECT_NE(server->Err().find("cache rank " + late + " not up at start"), std::string::npos)
      << server->Err();
  EXPECT_EQ(Request(port, "GET", "/health").status, 200);
  OpenStream first = StartStream(port, 2000);
  ASSERT_FALSE(first.first.empty()) << server->Err();
  EXPECT_EQ(Sessions(ranks[0]), 1);
  ::close(first.fd);

  // It comes up with the larger budget: once connected it takes the next request.
  ranks[1] = StartCache(late, 64);
  ASSERT_EQ(ranks[1].endpoint, late);
  EXPECT_TRUE(testing::WaitUntil(
      [&] { return server->Err().find("connected to cache rank " + late) != std::string::npos; },
      milliseconds(30000)))
      << server->Err();
  EXPECT_TRUE(testing::WaitUntil([&] { return Sessions(ranks[0]) == 0; }, milliseconds(20000)));
  OpenStream next = StartStream(port, 2000);
  ASSERT_FALSE(next.first.empty()) << server->Err();
  EXPECT_EQ(Sessions(ranks[1]), 1);
  ::close(next.fd);
  Stop(*server);
  for (CacheRank& rank : ranks) Stop(*rank.process);

  // None up: `rubato generate` fails at start, naming both.
  const std::string other = "127.0.0.1:" + std::to_string(testing::FreePort());
  const testing::ProcessResult none =
      testing::RunProcess(RUBATO_BINARY, {"generate", "--model", kModel, "--prompt", "Once",
                                          "--max-tokens", "4", "--policy", "offload_dense",
                                          "--config", config_, "--cache", late + "," + other});
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.err.find("none of the 2 cache ranks answered"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find(other), std::string::npos) << none.err;
}

}  // namespace
}  // namespace rubato
