// The placed residency on the CPU engine (docs/residency.md "Placement"): a KV pool that holds
// two of four requests whole keeps two local and places the other two on the cache rank, and
// every request's tokens are local dense's; the local ones read their whole KV in place, the
// others hold only the block being written. A request that fits no tier ends with an error
// naming the local pool and the cache rank's budget; losing the cache rank ends only the
// requests placed there; a policy that selects rows on the cache rank is refused by name.
#include "inference_rank/residency/placed/placed_residency.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"
#include "inference_rank/residency/residency_registry.h"

namespace rubato {
namespace {

using engine_test::Sampled;

// Four requests of 10 prompt tokens and 40 new ones: 49 positions, 4 blocks of 16 each whole;
// placed on the cache rank, 1 block (the prompt's, then the one being written).
constexpr int kRequests = 4;
constexpr int kPrompt = 10;
constexpr int kNewTokens = 40;
// Two whole requests (8 blocks) and the one block each of two placed on the cache rank.
constexpr int kPool = 10;

struct Output {
  std::vector<int> tokens;
  FinishReason finish = FinishReason::kNone;
  Status error;
};

struct PlacedRun {
  std::map<uint64_t, Output> outputs;
  int first_step_admitted = 0;
  int64_t preemptions = 0;
  int peak_blocks = 0;
  int free_blocks_after = -1;
  int pool_blocks = 0;
  uint64_t placed_local = 0;
  uint64_t placed_cache = 0;
  uint64_t sessions_peak = 0;  // sessions the cache rank held at once
  uint64_t sessions_open_after = 0;
};

class PlacedResidencyTest : public ::testing::Test {
 protected:
  std::unique_ptr<Model> LoadModel() {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/3);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    return std::move(model).value();
  }

  std::unique_ptr<ColocatedCacheRank> MakeCache(uint64_t budget = uint64_t{64} << 20) {
    CacheClientOptions client;
    client.timeout = std::chrono::milliseconds(2000);
    CacheServiceOptions service;
    service.budget_bytes = budget;
    auto cache = ColocatedCacheRank::Create(LoadModel()->config(), client, service);
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    return std::move(cache).value();
  }

  // kRequests sampled requests in a pool of `pool_blocks` (0: sized from memory), placed over
  // `cache` when set (else local KV); `lose_cache_after` > 0: the cache rank forgets this peer
  // after that many steps.
  PlacedRun Run(int pool_blocks, ColocatedCacheRank* cache, int lose_cache_after = 0) {
    EngineOptions options;
    options.max_batch = kRequests;
    options.max_context = 128;
    options.prefill_chunk = 128;
    options.num_threads = 2;
    options.max_kv_blocks = pool_blocks;
    std::shared_ptr<PlacedResidency> placed;
    if (cache != nullptr) {
      placed = std::make_shared<PlacedResidency>(
          std::make_shared<OffloadedResidency>(cache->client(), &cache->client()));
      options.residency = placed;
    }
    auto engine = Engine::Create(LoadModel(), options);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    PlacedRun run;
    if (!engine.ok()) return run;
    Engine& e = **engine;
    for (int r = 1; r <= kRequests; ++r)
      EXPECT_TRUE(e.Submit(Sampled(kPrompt, r, kNewTokens)).ok());
    for (int step = 0; e.HasWork(); ++step) {
      if (lose_cache_after > 0 && step == lose_cache_after) {
        cache->service().ForgetPeer(ColocatedCacheRank::kPeerId);
      }
      auto events = e.Step();
      EXPECT_TRUE(events.ok()) << events.status().ToString();
      if (!events.ok()) break;
      if (step == 0) run.first_step_admitted = static_cast<int>(e.admitted().size());
      for (const TokenEvent& event : *events) {
        Output& output = run.outputs[event.request_id];
        if (event.finish != FinishReason::kError) output.tokens.push_back(event.token);
        output.finish = event.finish;
        output.error = event.error;
      }
      if (cache != nullptr) {
        run.sessions_peak =
            std::max(run.sessions_peak, cache->service().Stats().store.sessions_open);
      }
    }
    run.preemptions = e.num_preemptions();
    run.peak_blocks = e.peak_used_blocks();
    run.free_blocks_after = e.kv_cache().free_blocks();
    run.pool_blocks = e.kv_cache().shape().num_blocks;
    if (placed != nullptr) {
      run.placed_local = placed->placed_local();
      run.placed_cache = placed->placed_cache();
    }
    if (cache != nullptr) run.sessions_open_after = cache->service().Stats().store.sessions_open;
    return run;
  }

  static std::map<uint64_t, std::vector<int>> Tokens(const PlacedRun& run) {
    std::map<uint64_t, std::vector<int>> tokens;
    for (const auto& [id, output] : run.outputs) tokens[id] = output.tokens;
    return tokens;
  }

  TestTempDir dir_{"placed_residency"};
};

// A pool of 10 blocks holds two of the four requests whole (4 blocks each): those two stay
// local, the other two go to the cache rank and hold one block each; all four run from the
// first step, nothing is preempted, and every request's tokens are local dense's.
TEST_F(PlacedResidencyTest, APoolForTwoOfFourKeepsTwoLocalAndPlacesTwoOnTheCacheRank) {
  const PlacedRun reference = Run(0, nullptr);
  ASSERT_EQ(reference.outputs.size(), size_t{kRequests});
  const PlacedRun local = Run(kPool, nullptr);
  EXPECT_GT(local.preemptions, 0) << "local dense holds every position: 16 blocks in 10";

  std::unique_ptr<ColocatedCacheRank> cache = MakeCache();
  const PlacedRun placed = Run(kPool, cache.get());
  EXPECT_EQ(placed.placed_local, 2u);
  EXPECT_EQ(placed.placed_cache, 2u);
  EXPECT_EQ(placed.sessions_peak, 2u);
  EXPECT_EQ(placed.first_step_admitted, kRequests);
  EXPECT_EQ(placed.preemptions, 0);
  EXPECT_EQ(Tokens(placed), Tokens(reference));
  EXPECT_EQ(placed.peak_blocks, kPool);
  EXPECT_EQ(placed.free_blocks_after, placed.pool_blocks);
  EXPECT_EQ(placed.sessions_open_after, 0u);
}

// With room for every request locally, placement keeps all of them local: the cache rank
// opens no session.
TEST_F(PlacedResidencyTest, APoolWithRoomForEveryRequestKeepsThemAllLocal) {
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache();
  const PlacedRun placed = Run(4 * kRequests, cache.get());
  EXPECT_EQ(placed.placed_local, size_t{kRequests});
  EXPECT_EQ(placed.placed_cache, 0u);
  EXPECT_EQ(placed.sessions_peak, 0u);
  EXPECT_EQ(Tokens(placed), Tokens(Run(0, nullptr)));
}

// A cache rank whose budget takes one session (a session of 50 positions: 2 layers x 2 KV heads
// x 50 x 16 x 4 bytes x 2 = 25.6 KB; the budget 40 KB): of the two requests the pool cannot
// keep, the second fits no tier and ends with an error naming the local pool and the budget;
// the other three give local dense's tokens.
TEST_F(PlacedResidencyTest, ARequestThatFitsNoTierIsRefusedNamingBoth) {
  const PlacedRun reference = Run(0, nullptr);
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(40 << 10);
  const PlacedRun placed = Run(kPool, cache.get());
  ASSERT_EQ(placed.outputs.size(), size_t{kRequests});
  const Output& refused = placed.outputs.at(4);
  EXPECT_EQ(refused.finish, FinishReason::kError);
  EXPECT_EQ(refused.error.code(), StatusCode::kResourceExhausted) << refused.error.message();
  EXPECT_NE(refused.error.message().find("no KV tier has room for its 50 positions: this rank's "
                                         "KV pool can take 16 more"),
            std::string::npos)
      << refused.error.message();
  EXPECT_NE(refused.error.message().find("budget"), std::string::npos) << refused.error.message();
  for (uint64_t id = 1; id <= 3; ++id) {
    EXPECT_EQ(placed.outputs.at(id).tokens, reference.outputs.at(id).tokens) << "request " << id;
  }
  EXPECT_EQ(placed.placed_local, 2u);
  EXPECT_EQ(placed.placed_cache, 1u);
  EXPECT_EQ(placed.free_blocks_after, placed.pool_blocks);
}

// The cache rank lost mid-run: the two requests placed there end with its error, the two local
// ones finish with local dense's tokens.
TEST_F(PlacedResidencyTest, LosingTheCacheRankEndsOnlyTheRequestsPlacedThere) {
  const PlacedRun reference = Run(0, nullptr);
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache();
  const PlacedRun placed = Run(kPool, cache.get(), /*lose_cache_after=*/3);
  ASSERT_EQ(placed.outputs.size(), size_t{kRequests});
  for (uint64_t id : {1u, 2u}) {
    EXPECT_NE(placed.outputs.at(id).finish, FinishReason::kError)
        << placed.outputs.at(id).error.message();
    EXPECT_EQ(placed.outputs.at(id).tokens, reference.outputs.at(id).tokens) << "request " << id;
  }
  for (uint64_t id : {3u, 4u}) {
    EXPECT_EQ(placed.outputs.at(id).finish, FinishReason::kError) << "request " << id;
    EXPECT_EQ(placed.outputs.at(id).error.code(), StatusCode::kUnavailable)
        << placed.outputs.at(id).error.message();
  }
  EXPECT_EQ(placed.free_blocks_after, placed.pool_blocks);
}

// Placement serves dense attention: oracle_topk (rows selected on the cache rank) is refused by
// name, and the table knows the name.
TEST_F(PlacedResidencyTest, APolicyThatSelectsRowsOnTheCacheRankIsRefusedByName) {
  const OracleTopKPolicy topk(OracleTopKConfig{.top_k = 16, .sink_tokens = 4, .recent_window = 8});
  const Status refused = CheckPlacedPolicy(&topk);
  EXPECT_EQ(refused.code(), StatusCode::kUnsupported) << refused.ToString();
  EXPECT_NE(refused.message().find("policy 'oracle_topk' selects rows on the cache rank"),
            std::string::npos)
      << refused.message();
  EXPECT_TRUE(CheckPlacedPolicy(nullptr).ok());
  const ModelConfig model = LoadModel()->config();
  ResidencySetup setup;
  setup.model = &model;
  setup.policy = &topk;
  const auto made = CreateResidency("placed", setup);
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("oracle_topk"), std::string::npos)
      << made.status().message();
}

}  // namespace
}  // namespace rubato
