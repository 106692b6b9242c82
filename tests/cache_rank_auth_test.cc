// The cache rank's RPC token through the real binaries: a cache rank started with
// RUBATO_CACHE_TOKEN refuses an inference rank without it (one clear error naming the
// authentication; the cache rank logs the peer, never the token, and counts it in
// rubato:cache_rank_auth_failures_total) and serves one with it; a cache rank that other hosts
// can reach refuses to start without a token, one on loopback warns.
// docs/security.md "The cache rank's RPC".
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <regex>
#include <string>
#include <vector>

#include "tests/cli_runner.h"
#include "tests/http_test_client.h"

namespace rubato {
namespace {

using std::chrono::milliseconds;
using testing::BackgroundProcess;
using testing::NonEmptyLines;
using testing::ProcessResult;
using testing::RunProcess;

std::string StartedEndpoint(BackgroundProcess& cache) {
  EXPECT_TRUE(cache.WaitForOutput("listening on", milliseconds(30000)))
      << cache.Out() << cache.Err();
  std::smatch match;
  const std::string out = cache.Out();
  return std::regex_search(out, match, std::regex("listening on (\\S+)")) ? match[1].str() : "";
}

ProcessResult GenerateWith(const std::string& endpoint) {
  return RunProcess(RUBATO_BINARY, {"generate", "--model", "models/tiny-qwen3-longctx", "--prompt",
                                    "The pass key is 4711.", "--max-tokens", "3", "--policy",
                                    "offload_dense", "--threads", "1", "--cache", endpoint});
}

// The cache rank's `rubato:cache_rank_auth_failures_total`, or -1 when /metrics has none.
double AuthFailures(BackgroundProcess& cache) {
  std::smatch match;
  const std::string out = cache.Out();
  if (!std::regex_search(out, match, std::regex("metrics on http://127\\.0\\.0\\.1:(\\d+)/"))) {
    return -1;
  }
  const std::string body = testing::Request(std::stoi(match[1]), "GET", "/metrics").body;
  if (!std::regex_search(body, match,
                         std::regex("\nrubato:cache_rank_auth_failures_total (\\S+)\n"))) {
    return -1;
  }
  return std::stod(match[1]);
}

TEST(CacheRankAuth, ATokenCacheRankServesOnlyPeersWithTheToken) {
  setenv("UCX_TLS", "tcp", 1);
  setenv("RUBATO_CACHE_TOKEN", "test-token-7f3a", 1);
  BackgroundProcess cache(RUBATO_BINARY,
                          {"cache", "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"});
  const std::string endpoint = StartedEndpoint(cache);
  ASSERT_FALSE(endpoint.empty());
  EXPECT_EQ(AuthFailures(cache), 0.0);
  EXPECT_EQ(cache.Err().find("no RPC token"), std::string::npos) << cache.Err();

  unsetenv("RUBATO_CACHE_TOKEN");
  const ProcessResult refused = GenerateWith(endpoint);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_FALSE(refused.signaled);
  ASSERT_EQ(NonEmptyLines(refused.err).size(), 1u) << refused.err;
  EXPECT_NE(refused.err.find("authentication failed"), std::string::npos) << refused.err;
  EXPECT_EQ(refused.err.find("test-token"), std::string::npos) << "the token is echoed";
  // The cache rank logged the refusal with the peer's address, counted it, and kept serving.
  EXPECT_NE(cache.Err().find("from 127.0.0.1:"), std::string::npos) << cache.Err();
  EXPECT_NE(cache.Err().find("authentication failed"), std::string::npos) << cache.Err();
  EXPECT_EQ(cache.Err().find("test-token"), std::string::npos) << cache.Err();
  EXPECT_EQ(AuthFailures(cache), 1.0);

  setenv("RUBATO_CACHE_TOKEN", "test-token-7f3a", 1);
  const ProcessResult served = GenerateWith(endpoint);
  EXPECT_EQ(served.exit_code, 0) << served.err;
  EXPECT_EQ(AuthFailures(cache), 1.0);
  unsetenv("RUBATO_CACHE_TOKEN");
}

TEST(CacheRankAuth, OnlyALoopbackCacheRankMayRunWithoutAToken) {
  unsetenv("RUBATO_CACHE_TOKEN");
  unsetenv("RUBATO_CACHE_TOKEN_FILE");
  for (const std::string listen : {"0.0.0.0:0", "[::]:0"}) {
    const ProcessResult refused = RunProcess(RUBATO_BINARY, {"cache", "--listen", listen}, 30);
    EXPECT_EQ(refused.exit_code, 1) << refused.out << refused.err;
    ASSERT_EQ(NonEmptyLines(refused.err).size(), 1u) << refused.err;
    EXPECT_NE(refused.err.find("--listen " + listen), std::string::npos) << refused.err;
    EXPECT_NE(refused.err.find("RUBATO_CACHE_TOKEN"), std::string::npos) << refused.err;
    EXPECT_EQ(refused.out.find("listening on"), std::string::npos) << refused.out;
  }
  // On loopback it starts, and says at once that any local process can use it.
  BackgroundProcess cache(RUBATO_BINARY, {"cache", "--listen", "127.0.0.1:0"});
  ASSERT_FALSE(StartedEndpoint(cache).empty());
  EXPECT_NE(cache.Err().find("any local process can connect"), std::string::npos) << cache.Err();
}

}  // namespace
}  // namespace rubato
