// Several GPU cache ranks behind one inference rank (DeviceCacheRankResidency over three cache
// rank threads, each with a data plane of its own to the model's GPU; cuda_peer on one GPU,
// NCCL on four): requests placed one per rank give local dense's tokens; losing rank 1 ends only
// its request, naming it; a restarted rank 1 is reconnected and takes new requests. Helpers:
// device_cache_rank_test_util.h; the fixture is instantiated in device_cache_rank_test.cc.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "inference_rank/engine/engine.h"
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/device_cache_rank_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::device_cache_test {
namespace {

using std::chrono::milliseconds;

// Three cache ranks on the cache GPU, each with a data plane of its own to the model's GPU 0.
struct ThreeCacheRanks {
  std::vector<std::unique_ptr<CacheRankConnection>> first;  // as connected at the start
  std::atomic<bool> restarted{false};                       // rank 1's endpoint answers again
  std::atomic<CacheRankConnection*> reconnected{nullptr};   // rank 1's new one (the residency's)
  std::shared_ptr<DeviceCacheRankResidency> residency;      // last: goes first, with its watcher
};

// With `restartable`, rank 1 is reconnected once lost and `restarted`: each connection a new
// cache rank thread (an empty store) on its GPU with a new data plane.
void MakeThreeCacheRanks(const std::string& kind, const ModelConfig& config, int cache_device,
                         ThreeCacheRanks& ranks, bool restartable = false) {
  // NCCL: each cache rank on a GPU of its own (1, 2, 3). Three servers of one process on one GPU
  // share a CUDA context, where one's device-synchronising call (a workspace cudaFree) waits for
  // another's NCCL kernel, which waits for the model: separate processes (the launch) or GPUs.
  const bool own_gpus = kind == "nccl";
  const DevicePlaneLimits limits{.max_runs = 4, .max_rows = 4 * 32};
  std::vector<DeviceCacheRankPeer> peers;
  for (int r = 0; r < 3; ++r) {
    const int device = own_gpus ? 1 + r : cache_device;
    ranks.first.push_back(std::make_unique<CacheRankConnection>(kind, config, device, limits));
    ASSERT_TRUE(ranks.first.back()->ready());
    DeviceCacheRankPeer& peer = peers.emplace_back();
    peer.client = &ranks.first.back()->client();
    peer.control = ranks.first.back().get();
    peer.name = "cache rank " + std::to_string(r);
    if (!restartable || r != 1) continue;
    peer.reconnect = [&ranks, &config, kind, device,
                      limits](const std::atomic<bool>*) -> Result<DeviceCacheRankConnection> {
      if (!ranks.restarted) return UnavailableError("cache rank 1: connection refused");
      auto again = std::make_unique<CacheRankConnection>(kind, config, device, limits);
      if (!again->ready()) return InternalError("cache rank 1 did not come back");
      ranks.reconnected = again.get();
      DevicePlaneClient* client = &again->client();
      return DeviceCacheRankConnection{std::move(again), client};
    };
  }
  ranks.residency = std::make_shared<DeviceCacheRankResidency>(
      std::move(peers), ReconnectBackoff{milliseconds(20), milliseconds(200)});
}

struct ThreeRequests {
  std::vector<std::vector<int>> tokens;  // [prompt]
  std::vector<std::string> errors;       // [prompt] its error event's message, or ""
};

// Runs the prompts to their end (40 new tokens each); `after_step(step)` after each step.
ThreeRequests RunPrompts(Engine& engine, const std::vector<std::vector<int>>& prompts,
                         const std::function<void(int)>& after_step) {
  ThreeRequests run{std::vector<std::vector<int>>(prompts.size()),
                    std::vector<std::string>(prompts.size())};
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest request;
    request.prompt_ids = prompts[i];
    request.max_new_tokens = 40;
    auto id = engine.Submit(request);
    EXPECT_TRUE(id.ok()) << id.status().message();
    if (id.ok()) index[*id] = i;
  }
  for (int step = 0; engine.HasWork() && step < 10000; ++step) {
    auto events = engine.Step();
    EXPECT_TRUE(events.ok()) << events.status().message();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      const size_t r = index[event.request_id];
      if (!event.error.ok()) run.errors[r] = event.error.message();
      if (event.error.ok()) run.tokens[r].push_back(event.token);
    }
    if (after_step) after_step(step);
  }
  return run;
}

// Each request that ended names lost rank 1; the others gave local dense's tokens. How many
// ended.
int ExpectDenseOrRankOneLost(const ThreeRequests& run, const std::vector<std::vector<int>>& dense,
                             const std::string& kind) {
  int failed = 0;
  for (size_t r = 0; r < dense.size(); ++r) {
    if (!run.errors[r].empty()) {
      ++failed;
      EXPECT_NE(run.errors[r].find("cache rank 1 of 3"), std::string::npos) << run.errors[r];
      EXPECT_NE(run.errors[r].find("lost on purpose"), std::string::npos) << run.errors[r];
      continue;
    }
    EXPECT_EQ(run.tokens[r], dense[r]) << kind << " request " << r;
  }
  return failed;
}

// Why three cache ranks of `kind` in this process cannot run here, or "".
std::string WhyNotThreeRanks(const std::string& kind) {
  if (kind != "nccl" || DeviceCount() >= 4) return "";
  return "three NCCL cache ranks of one process need GPUs 1-3 (nvidia-h200-x4); "
         "scripts/gpu/lose_cache_rank.py runs three cache processes on two GPUs";
}

// Three requests over three cache ranks (placed by free budget: one each) give local dense's
// tokens; with `lose_after` >= 0, cache rank 1 goes away after that engine step and only its
// request ends, with an error naming it.
void ExpectThreeCacheRanks(const std::string& kind, int cache_device, bool use_graphs,
                           int lose_after) {
  if (const std::string why = WhyNotThreeRanks(kind); !why.empty()) GTEST_SKIP() << why;
  EngineRun run(use_graphs);
  ASSERT_TRUE(run.config.ok()) << run.config.status().message();
  auto load = [&] { return run.Load(); };
  const auto dense = cuda_model_test::EngineGreedyTokens(load(), run.options, run.prompts);

  ThreeCacheRanks ranks;
  MakeThreeCacheRanks(kind, *run.config, cache_device, ranks);
  ASSERT_NE(ranks.residency, nullptr);
  run.options.residency = ranks.residency;
  auto engine = Engine::Create(load(), run.options);
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  const ThreeRequests done = RunPrompts(**engine, run.prompts, [&](int step) {
    if (step == lose_after) ranks.first[1]->thread().Lose();
  });
  EXPECT_EQ(ExpectDenseOrRankOneLost(done, dense, kind), lose_after >= 0 ? 1 : 0);
  std::printf("[ device    ] %s graphs %d, three cache ranks%s:%s\n", kind.c_str(), use_graphs,
              lose_after >= 0 ? ", rank 1 lost" : "", ranks.residency->StatsLine().c_str());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (size_t r = 0; r < 3; ++r) {
    if (r == 1 && lose_after >= 0) continue;
    ASSERT_STATUS_OK(ranks.first[r]->Stop(stream));
    // Placement gave every rank a request.
    EXPECT_GT(ranks.first[r]->thread().server().stats().steps.load(), 5u);
  }
  (void)cudaStreamDestroy(stream);
}

TEST_P(DeviceCacheRankTest, ThreeCacheRanksGiveLocalDenseTokensEagerly) {
  ExpectThreeCacheRanks(GetParam(), cache_device_, /*use_graphs=*/false, /*lose_after=*/-1);
}

TEST_P(DeviceCacheRankTest, ThreeCacheRanksGiveLocalDenseTokensWithGraphs) {
  ExpectThreeCacheRanks(GetParam(), cache_device_, /*use_graphs=*/true, /*lose_after=*/-1);
}

TEST_P(DeviceCacheRankTest, LosingOneOfThreeCacheRanksEndsOnlyItsRequest) {
  ExpectThreeCacheRanks(GetParam(), cache_device_, /*use_graphs=*/true, /*lose_after=*/12);
}

// Rank 1 goes away after step 12 (its request ends, as above) and its endpoint answers again:
// once that request has ended the residency connects to it anew, and three new requests go one
// to each rank (equal free budgets), the restarted one included, with local dense's tokens.
TEST_P(DeviceCacheRankTest, RestartedCacheRankTakesNewRequests) {
  const std::string kind = GetParam();
  if (const std::string why = WhyNotThreeRanks(kind); !why.empty()) GTEST_SKIP() << why;
  EngineRun run(/*use_graphs=*/true);
  ASSERT_TRUE(run.config.ok()) << run.config.status().message();
  auto load = [&] { return run.Load(); };
  const auto dense = cuda_model_test::EngineGreedyTokens(load(), run.options, run.prompts);

  ThreeCacheRanks ranks;
  MakeThreeCacheRanks(kind, *run.config, cache_device_, ranks, /*restartable=*/true);
  ASSERT_NE(ranks.residency, nullptr);
  run.options.residency = ranks.residency;
  auto engine = Engine::Create(load(), run.options);
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  const ThreeRequests lost = RunPrompts(**engine, run.prompts, [&](int step) {
    if (step == 12) ranks.first[1]->thread().Lose();
  });
  EXPECT_EQ(ExpectDenseOrRankOneLost(lost, dense, kind), 1);

  ranks.restarted = true;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (ranks.residency->reconnects() == 0 && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_EQ(ranks.residency->reconnects(), 1);
  ranks.restarted = false;  // a later loss (the stops below) is not reconnected
  const ThreeRequests again = RunPrompts(**engine, run.prompts, nullptr);
  EXPECT_EQ(ExpectDenseOrRankOneLost(again, dense, kind), 0);

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (CacheRankConnection* rank :
       {ranks.first[0].get(), ranks.reconnected.load(), ranks.first[2].get()}) {
    ASSERT_STATUS_OK(rank->Stop(stream));
    EXPECT_GT(rank->thread().server().stats().steps.load(), 5u);
  }
  (void)cudaStreamDestroy(stream);
  run.options.residency.reset();  // it goes with `ranks`, its watcher before the connections
}
}  // namespace
}  // namespace rubato::device_cache_test
