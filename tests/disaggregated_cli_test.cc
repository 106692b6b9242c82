// The disaggregated mode end to end, as a user runs it: `rubato cache --listen` in one process,
// `rubato generate --cache HOST:PORT` in another, KV over UCX (TCP), control over the RPC, on the
// bundled tiny model: dense text through the cache rank, a killed, stopped or restarted cache
// rank, one that never answers, mpirun roles, and bad uses refused by name. The scenarios:
// docs/disaggregated.md "Tests".
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "tests/cli_runner.h"
#include "tests/http_test_client.h"

namespace rubato {
namespace {

using std::chrono::milliseconds;
using testing::BackgroundProcess;
using testing::ProcessResult;
using testing::RunProcess;

constexpr const char* kModel = "models/tiny-qwen3-longctx";
constexpr const char* kPrompt = "The passkey is 4711. Remember it. What is the passkey?";

// The generated text: stdout without the final stats line.
std::string GeneratedText(const std::string& out) {
  const size_t stats = out.rfind("\n[rubato]");
  return stats == std::string::npos ? out : out.substr(0, stats);
}

class DisaggregatedCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // UCX over TCP for every child: the transport that notices a dead peer, between pods too.
    setenv("UCX_TLS", "tcp", 1);
    // Heartbeats every 100 ms: a lost cache rank shows within 5 of them (0.5 s).
    config_ = (dir_.path() / "fast_heartbeat.yaml").string();
    std::ofstream(config_) << "limits:\n  heartbeat_ms: 100\n  rpc_timeout_ms: 2000\n";
    topk_config_ = (dir_.path() / "topk.yaml").string();
    std::ofstream(topk_config_) << "policy:\n  name: offload_topk\n  top_k: 4096\n"
                                   "  sink_tokens: 4\n  recent_window: 8\n";
  }

  // Starts a cache rank on `listen` and returns it once it prints its endpoint.
  std::unique_ptr<BackgroundProcess> StartCache(const std::string& listen = "127.0.0.1:0",
                                                const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args{"cache", "--listen", listen, "--config", config_};
    args.insert(args.end(), extra.begin(), extra.end());
    auto cache = std::make_unique<BackgroundProcess>(RUBATO_BINARY, args);
    EXPECT_TRUE(cache->WaitForOutput("listening on", milliseconds(20000)))
        << cache->Out() << cache->Err();
    std::smatch match;
    const std::string out = cache->Out();
    if (std::regex_search(out, match, std::regex("listening on (\\S+)"))) endpoint_ = match[1];
    return cache;
  }

  std::vector<std::string> GenerateArgs(const std::string& policy, int max_tokens) {
    return {"generate", "--model", kModel, "--prompt", kPrompt, "--max-tokens",
            std::to_string(max_tokens), "--policy", policy, "--threads", "1"};
  }

  // An offload_dense run far longer than the tests wait (4000 tokens), fast heartbeats.
  std::vector<std::string> LongOffloadedRun() {
    std::vector<std::string> args = GenerateArgs("offload_dense", 4000);
    args.insert(args.end(), {"--config", config_});
    return args;
  }

  TestTempDir dir_{"disaggregated_cli"};
  std::string config_;
  std::string topk_config_;
  std::string endpoint_;
};

TEST_F(DisaggregatedCliTest, AStandaloneCacheRankGivesTheColocatedDenseText) {
  const ProcessResult dense = RunProcess(RUBATO_BINARY, GenerateArgs("dense", 24));
  ASSERT_EQ(dense.exit_code, 0) << dense.err;
  ASSERT_FALSE(GeneratedText(dense.out).empty());

  std::unique_ptr<BackgroundProcess> cache = StartCache();
  ASSERT_FALSE(endpoint_.empty());
  std::vector<std::string> args = GenerateArgs("offload_dense", 24);
  args.insert(args.end(), {"--cache", endpoint_, "--config", config_});
  const ProcessResult offloaded = RunProcess(RUBATO_BINARY, args);
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.err;
  EXPECT_EQ(GeneratedText(offloaded.out), GeneratedText(dense.out));
  EXPECT_NE(offloaded.out.find("policy=offload_dense"), std::string::npos) << offloaded.out;

  std::vector<std::string> topk = GenerateArgs("offload_topk", 24);
  topk.erase(topk.end() - 4, topk.end() - 2);  // the policy comes from the config file
  topk.insert(topk.end(), {"--cache", endpoint_, "--config", topk_config_});
  const ProcessResult selected = RunProcess(RUBATO_BINARY, topk);
  ASSERT_EQ(selected.exit_code, 0) << selected.err;
  EXPECT_EQ(GeneratedText(selected.out), GeneratedText(dense.out));
  EXPECT_NE(selected.out.find(" delta_replies=1 "), std::string::npos) << selected.out;
  // topology.delta_replies: false: every selected row every step, the same tokens.
  const std::string full_config = (dir_.path() / "topk_full_replies.yaml").string();
  std::ofstream(full_config) << "policy:\n  name: offload_topk\n  top_k: 4096\n"
                                "  sink_tokens: 4\n  recent_window: 8\n"
                                "topology:\n  delta_replies: false\n";
  topk.back() = full_config;
  const ProcessResult full = RunProcess(RUBATO_BINARY, topk);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  EXPECT_EQ(GeneratedText(full.out), GeneratedText(dense.out));
  EXPECT_NE(full.out.find(" delta_replies=0 "), std::string::npos) << full.out;

  cache->Signal(SIGTERM);
  const ProcessResult stopped = cache->Wait(milliseconds(10000));
  EXPECT_EQ(stopped.exit_code, 0) << stopped.err;
  // Three runs of 24 tokens over 28 layers in packs of 4: 7 packs a step, one reply each.
  std::smatch packs;
  ASSERT_TRUE(std::regex_search(stopped.out, packs, std::regex("packs=(\\d+) replies=(\\d+)")))
      << stopped.out;
  EXPECT_GT(std::stoi(packs[1]), 0);
  EXPECT_EQ(packs[1], packs[2]);
}

// `rubato cache --metrics HOST:PORT` serves its registry over HTTP: sessions, memory and the
// transport bytes of what it served; GET and HEAD of /health and /metrics; 404 for other
// routes, 405 with Allow for other methods.
TEST_F(DisaggregatedCliTest, TheCacheRanksMetricsEndpointCountsWhatItServed) {
  std::unique_ptr<BackgroundProcess> cache =
      StartCache("127.0.0.1:0", {"--metrics", "127.0.0.1:0"});
  ASSERT_FALSE(endpoint_.empty());
  std::smatch match;
  const std::string out = cache->Out();
  ASSERT_TRUE(
      std::regex_search(out, match, std::regex("metrics on http://127\\.0\\.0\\.1:(\\d+)/metrics")))
      << out;
  const int port = std::stoi(match[1]);
  EXPECT_EQ(testing::Request(port, "GET", "/health").status, 200);
  // HEAD (what load balancers and curl -I send): the status and headers of GET, no body.
  const testing::HttpResponse head = testing::Request(port, "HEAD", "/health");
  EXPECT_EQ(head.status, 200);
  EXPECT_TRUE(head.body.empty()) << head.body;
  EXPECT_EQ(testing::Request(port, "HEAD", "/metrics").status, 200);
  const testing::HttpResponse before = testing::Request(port, "GET", "/metrics");
  ASSERT_EQ(before.status, 200);
  EXPECT_NE(before.body.find("\nrubato:cache_rank_sessions 0\n"), std::string::npos) << before.body;
  EXPECT_NE(before.body.find("rubato:cache_rank_memory_bytes{"), std::string::npos) << before.body;

  std::vector<std::string> args = GenerateArgs("offload_dense", 8);
  args.insert(args.end(), {"--cache", endpoint_, "--config", config_});
  const ProcessResult offloaded = RunProcess(RUBATO_BINARY, args);
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.err;
  std::smatch sent;
  ASSERT_TRUE(std::regex_search(offloaded.out, sent, std::regex("offload_bytes_sent=(\\d+)")))
      << offloaded.out;

  // The inference rank's bytes sent are the cache rank's bytes received.
  const testing::HttpResponse after = testing::Request(port, "GET", "/metrics");
  ASSERT_EQ(after.status, 200);
  std::smatch received;
  ASSERT_TRUE(std::regex_search(
      after.body, received,
      std::regex("rubato:transport_bytes_total\\{[^}]*direction=\"rx\"[^}]*\\} (\\d+)")))
      << after.body;
  EXPECT_EQ(received[1].str(), sent[1].str()) << after.body;
  EXPECT_NE(after.body.find("\nrubato:cache_rank_sessions 0\n"), std::string::npos)
      << "the finished run closed its session\n" << after.body;
  EXPECT_EQ(testing::Request(port, "GET", "/v1/models").status, 404);
  testing::HttpResponse post = testing::Request(port, "POST", "/metrics");
  EXPECT_EQ(post.status, 405);
  EXPECT_EQ(post.headers["allow"], "GET, HEAD");
  EXPECT_EQ(testing::Request(port, "DELETE", "/health").status, 405);

  cache->Signal(SIGTERM);
  EXPECT_EQ(cache->Wait(milliseconds(10000)).exit_code, 0);

  const ProcessResult bad = RunProcess(RUBATO_BINARY, {"cache", "--metrics", "nowhere"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--metrics"), std::string::npos) << bad.err;
}

// Starts a long offloaded generation, lets it produce some text, does `interrupt` to the cache
// rank, and expects the run to end with one error line naming the cache rank.
void ExpectTheRunEndsWithAClearError(BackgroundProcess& cache, const std::string& endpoint,
                                     std::vector<std::string> args, int signal) {
  args.insert(args.end(), {"--cache", endpoint});
  BackgroundProcess generate(RUBATO_BINARY, args);
  ASSERT_TRUE(generate.WaitForOutputBytes(40, milliseconds(30000))) << generate.Err();
  const auto interrupted = std::chrono::steady_clock::now();
  cache.Signal(signal);
  const ProcessResult result = generate.Wait(milliseconds(15000));
  const auto took = std::chrono::steady_clock::now() - interrupted;
  ASSERT_FALSE(result.signaled) << "generate was killed: it hung or crashed\n" << result.err;
  EXPECT_EQ(result.exit_code, 1) << result.out << result.err;
  EXPECT_NE(result.err.find("rubato: error: "), std::string::npos) << result.err;
  EXPECT_NE(result.err.find("cache rank " + endpoint), std::string::npos) << result.err;
  // Well inside the wait above: 5 heartbeats of 100 ms, plus the CI machine's slack.
  EXPECT_LT(took, milliseconds(10000)) << result.err;
}

TEST_F(DisaggregatedCliTest, AKilledCacheRankEndsTheRunAndARestartedOneServesAgain) {
  std::unique_ptr<BackgroundProcess> cache = StartCache();
  ASSERT_FALSE(endpoint_.empty());
  ExpectTheRunEndsWithAClearError(*cache, endpoint_, LongOffloadedRun(), SIGKILL);
  const ProcessResult killed = cache->Wait(milliseconds(5000));
  EXPECT_TRUE(killed.signaled);

  // A new cache rank on the same port: a new run connects to it.
  const std::string endpoint = endpoint_;
  std::unique_ptr<BackgroundProcess> restarted = StartCache(endpoint);
  ASSERT_EQ(endpoint_, endpoint) << restarted->Err();
  std::vector<std::string> again = GenerateArgs("offload_dense", 8);
  again.insert(again.end(), {"--cache", endpoint, "--config", config_});
  const ProcessResult result = RunProcess(RUBATO_BINARY, again);
  EXPECT_EQ(result.exit_code, 0) << result.err;
}

TEST_F(DisaggregatedCliTest, AStoppedCacheRankEndsTheRunWithinTheHeartbeatTimeout) {
  std::unique_ptr<BackgroundProcess> cache = StartCache();
  ASSERT_FALSE(endpoint_.empty());
  ExpectTheRunEndsWithAClearError(*cache, endpoint_, LongOffloadedRun(), SIGSTOP);
  cache->Signal(SIGCONT);
}

// A cache rank that accepts the connection and never answers (a stalled process: the kernel
// completes the handshake into the listen queue, nothing reads it) is given up within the
// heartbeat timeout, with an error naming the cache rank. The bound is generous (a busy 2-core
// machine); what matters is that the run ends, and with this error.
TEST_F(DisaggregatedCliTest, ACacheRankThatNeverAnswersIsGivenUpNamingIt) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener, 8), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const std::string endpoint = "127.0.0.1:" + std::to_string(ntohs(address.sin_port));
  // A long rpc_timeout_ms: the heartbeats (100 ms, 5 of them) are what must notice.
  const std::string config = (dir_.path() / "slow_calls.yaml").string();
  std::ofstream(config) << "limits:\n  heartbeat_ms: 100\n  rpc_timeout_ms: 600000\n";
  std::vector<std::string> args = GenerateArgs("offload_dense", 4);
  args.insert(args.end(), {"--cache", endpoint, "--config", config});
  const ProcessResult result = RunProcess(RUBATO_BINARY, args, 60);
  close(listener);
  ASSERT_FALSE(result.signaled) << "generate hung\n" << result.err;
  EXPECT_EQ(result.exit_code, 1) << result.err;
  EXPECT_NE(result.err.find("rubato: error: cache rank " + endpoint), std::string::npos)
      << result.err;
  EXPECT_NE(result.err.find("sent nothing"), std::string::npos) << result.err;
}

#ifdef RUBATO_MPIEXEC
// `mpirun -np 2 rubato generate --config configs/disagg-mpi.yaml`: rank 0 the inference rank,
// rank 1 the cache rank (roles from the config), the dense text, and the job ends by itself.
TEST_F(DisaggregatedCliTest, MpirunWithTwoRanksGivesTheColocatedDenseText) {
  // CI runs as root in a container with fewer cores than ranks.
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  // The sanitizer pass: OpenMPI's own start-up leaks are suppressed by name (the file says which;
  // the ranks inherit mpirun's environment). No effect on a build without sanitizers.
  setenv("LSAN_OPTIONS",
         "suppressions=" RUBATO_LSAN_OPENMPI_SUPPRESSIONS
         ":fast_unwind_on_malloc=0:print_suppressions=0",
         1);
  const ProcessResult dense = RunProcess(RUBATO_BINARY, GenerateArgs("dense", 24));
  ASSERT_EQ(dense.exit_code, 0) << dense.err;
  const ProcessResult mpi = RunProcess(
      RUBATO_MPIEXEC, {"-np", "2", "--oversubscribe", RUBATO_BINARY, "generate", "--config",
                       "configs/disagg-mpi.yaml", "--prompt", kPrompt, "--max-tokens", "24",
                       "--threads", "1"},
      120);
  ASSERT_FALSE(mpi.signaled) << "mpirun hung\n" << mpi.out << mpi.err;
  ASSERT_EQ(mpi.exit_code, 0) << mpi.out << mpi.err;
  EXPECT_NE(mpi.out.find("rubato cache (mpi rank 1): listening on"), std::string::npos)
      << mpi.out;
  EXPECT_NE(mpi.out.find("policy=offload_dense"), std::string::npos) << mpi.out;
  // The inference rank's text, between the cache rank's lines: the dense text is in it.
  EXPECT_NE(mpi.out.find(GeneratedText(dense.out)), std::string::npos)
      << "mpirun:\n" << mpi.out << "\ndense:\n" << dense.out;
  EXPECT_NE(mpi.out.find("rubato cache: stopped (a peer asked"), std::string::npos) << mpi.out;
}

// `mpirun -np 4` with configs/disagg-mpi-3cache.yaml: one inference rank and three cache ranks
// (docs/disaggregated.md "Several cache ranks"); the request is placed on one of them, the text
// is dense, and the inference rank stops all three.
TEST_F(DisaggregatedCliTest, MpirunWithThreeCacheRanksGivesTheColocatedDenseText) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("LSAN_OPTIONS",
         "suppressions=" RUBATO_LSAN_OPENMPI_SUPPRESSIONS
         ":fast_unwind_on_malloc=0:print_suppressions=0",
         1);
  const ProcessResult dense = RunProcess(RUBATO_BINARY, GenerateArgs("dense", 24));
  ASSERT_EQ(dense.exit_code, 0) << dense.err;
  const ProcessResult mpi = RunProcess(
      RUBATO_MPIEXEC, {"-np", "4", "--oversubscribe", RUBATO_BINARY, "generate", "--config",
                       "configs/disagg-mpi-3cache.yaml", "--prompt", kPrompt, "--max-tokens",
                       "24", "--threads", "1"},
      120);
  ASSERT_FALSE(mpi.signaled) << "mpirun hung\n" << mpi.out << mpi.err;
  ASSERT_EQ(mpi.exit_code, 0) << mpi.out << mpi.err;
  for (const char* rank : {"1", "2", "3"}) {
    EXPECT_NE(mpi.out.find("rubato cache (mpi rank " + std::string(rank) + "): listening on"),
              std::string::npos)
        << mpi.out;
  }
  EXPECT_NE(mpi.out.find(GeneratedText(dense.out)), std::string::npos) << mpi.out;
  size_t stopped = 0;
  for (size_t at = mpi.out.find("rubato cache: stopped (a peer asked"); at != std::string::npos;
       at = mpi.out.find("rubato cache: stopped (a peer asked", at + 1)) {
    ++stopped;
  }
  EXPECT_EQ(stopped, 3u) << mpi.out;
}
#endif

// topology.transport nccl where it cannot work is refused by name, and the cache rank serves
// on: in a build without NCCL (CI's sanitizer pass: "built without NCCL") and in a CUDA build
// on a machine without a GPU (CI's first pass: NCCL or CUDA says why, the Hello fails, and the
// inference rank gives up its half at once). With two GPUs: tests/gpu and scripts/gpu/run's
// transport stage.
TEST_F(DisaggregatedCliTest, AnNcclDataPlaneThatCannotFormIsRefusedByName) {
  std::unique_ptr<BackgroundProcess> cache = StartCache();
  ASSERT_FALSE(endpoint_.empty());
  const std::string nccl_config = (dir_.path() / "nccl.yaml").string();
  std::ofstream(nccl_config) << "limits:\n  heartbeat_ms: 100\n  rpc_timeout_ms: 2000\n"
                                "topology:\n  transport: nccl\n";
  std::vector<std::string> args = GenerateArgs("offload_dense", 4);
  args.insert(args.end(), {"--cache", endpoint_, "--config", nccl_config});
  const ProcessResult refused = RunProcess(RUBATO_BINARY, args, 60);
  EXPECT_EQ(refused.exit_code, 1) << refused.err;
  EXPECT_NE(refused.err.find(endpoint_), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("nccl"), std::string::npos) << refused.err;
  // The cache rank is unharmed: a UCX run right after works.
  std::vector<std::string> ucx = GenerateArgs("offload_dense", 4);
  ucx.insert(ucx.end(), {"--cache", endpoint_, "--config", config_});
  const ProcessResult served = RunProcess(RUBATO_BINARY, ucx, 60);
  EXPECT_EQ(served.exit_code, 0) << served.err;
  cache->Signal(SIGTERM);
  EXPECT_EQ(cache->Wait(milliseconds(10000)).exit_code, 0);
}

TEST_F(DisaggregatedCliTest, BadUsesAreRefusedByName) {
  // A cache endpoint holds offloaded KV: local KV asked for by name is refused. (Without
  // --kv-residency, a cache endpoint makes the default residency, auto, offloaded.)
  ProcessResult result = RunProcess(RUBATO_BINARY, [&] {
    std::vector<std::string> args = GenerateArgs("dense", 4);
    args.insert(args.end(), {"--cache", "127.0.0.1:9", "--kv-residency", "local"});
    return args;
  }());
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.err.find("offload_dense"), std::string::npos) << result.err;

  // Nothing listens there: the connection is refused, by name.
  std::vector<std::string> args = GenerateArgs("offload_dense", 4);
  args.insert(args.end(), {"--cache", "127.0.0.1:9", "--config", config_});
  result = RunProcess(RUBATO_BINARY, args, 30);
  EXPECT_EQ(result.exit_code, 1) << result.err;
  EXPECT_NE(result.err.find("127.0.0.1:9"), std::string::npos) << result.err;

  // A list of cache ranks with an empty entry.
  args = GenerateArgs("offload_dense", 4);
  args.insert(args.end(), {"--cache", "127.0.0.1:9,,127.0.0.1:10"});
  result = RunProcess(RUBATO_BINARY, args, 30);
  EXPECT_EQ(result.exit_code, 1) << result.err;
  EXPECT_NE(result.err.find("--cache '127.0.0.1:9,,127.0.0.1:10': cache rank 1 is empty"),
            std::string::npos)
      << result.err;

  // --listen that is no endpoint.
  result = RunProcess(RUBATO_BINARY, {"cache", "--listen", "nowhere"}, 30);
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.err.find("--listen"), std::string::npos) << result.err;
}

}  // namespace
}  // namespace rubato
