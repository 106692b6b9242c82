// The cache rank's RPC token through the real binaries: a cache rank started with
// RUBATO_CACHE_TOKEN refuses an inference rank without it (one clear error naming the
// authentication) and serves one with it; a cache rank without a token serves no Shutdown.
// docs/security.md "The cache rank's RPC".
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <regex>
#include <string>
#include <vector>

#include "tests/cli_runner.h"

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

TEST(CacheRankAuth, ATokenCacheRankServesOnlyPeersWithTheToken) {
  setenv("UCX_TLS", "tcp", 1);
  setenv("RUBATO_CACHE_TOKEN", "test-token-7f3a", 1);
  BackgroundProcess cache(RUBATO_BINARY, {"cache", "--listen", "127.0.0.1:0"});
  const std::string endpoint = StartedEndpoint(cache);
  ASSERT_FALSE(endpoint.empty());

  unsetenv("RUBATO_CACHE_TOKEN");
  const ProcessResult refused = GenerateWith(endpoint);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_FALSE(refused.signaled);
  ASSERT_EQ(NonEmptyLines(refused.err).size(), 1u) << refused.err;
  EXPECT_NE(refused.err.find("authentication failed"), std::string::npos) << refused.err;
  EXPECT_EQ(refused.err.find("test-token"), std::string::npos) << "the token is echoed";

  setenv("RUBATO_CACHE_TOKEN", "test-token-7f3a", 1);
  const ProcessResult served = GenerateWith(endpoint);
  EXPECT_EQ(served.exit_code, 0) << served.err;
  unsetenv("RUBATO_CACHE_TOKEN");
}

}  // namespace
}  // namespace rubato
