// Delta replies of offloaded oracle_topk, through the engine and the colocated cache rank (the
// same client, packs, service and replies as two processes): 64 greedy tokens equal local
// oracle_topk's with a top_k that keeps the selection changing, with and without deltas; deltas
// receive fewer bytes and rows than full replies and the stats line says so.
// Narrative: docs/disaggregated.md "Delta replies".
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "inference_rank/engine/engine.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"

namespace rubato {
namespace {

constexpr char kModel[] = "models/tiny-qwen3-longctx";
constexpr OracleTopKConfig kTopK{.top_k = 16, .sink_tokens = 4, .recent_window = 8};

struct GreedyRun {
  std::vector<int> tokens;
  std::string stats;
};

// 64 greedy tokens of a fixed prompt under oracle_topk (kTopK), offloaded through `cache` when
// set; `stop` is the only stop id.
GreedyRun Greedy(ColocatedCacheRank* cache, int stop) {
  ModelLoadOptions load;
  load.num_threads = 2;
  auto model = CpuModel::Load(kModel, load);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return {};
  const int vocab = (*model)->config().vocab_size;
  EngineOptions options;
  options.max_batch = 1;
  options.max_context = 128;
  options.prefill_chunk = 64;
  options.num_threads = 2;
  options.policy = std::make_shared<OracleTopKPolicy>(kTopK);
  std::shared_ptr<OffloadedResidency> residency;
  if (cache != nullptr) {
    residency = std::make_shared<OffloadedResidency>(cache->client(), &cache->client());
    options.residency = residency;
  }
  auto engine = Engine::Create(std::unique_ptr<Model>(std::move(model).value()), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  GenerationRequest request;
  for (int i = 0; i < 29; ++i) request.prompt_ids.push_back((i * 131 + 7) % vocab);
  request.max_new_tokens = 64;
  request.stop_token_ids = {stop};
  request.sampling.temperature = 0.0f;
  EXPECT_TRUE((*engine)->Submit(request).ok());
  GreedyRun run;
  while ((*engine)->HasWork()) {
    auto events = (*engine)->Step();
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      EXPECT_NE(event.finish, FinishReason::kError) << event.error.message();
      if (event.finish != FinishReason::kError) run.tokens.push_back(event.token);
    }
  }
  if (residency != nullptr) run.stats = residency->StatsLine();
  return run;
}

std::unique_ptr<ColocatedCacheRank> MakeCache(const ModelConfig& model, bool deltas) {
  CacheClientOptions client;
  client.selection = {.name = "oracle_topk",
                      .top_k = kTopK.top_k,
                      .sink_tokens = kTopK.sink_tokens,
                      .recent_tokens = kTopK.recent_window};
  client.delta_replies = deltas;
  CacheServiceOptions service;
  service.budget_bytes = uint64_t{64} << 20;
  auto cache = ColocatedCacheRank::Create(model, client, service);
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return cache.ok() ? std::move(cache).value() : nullptr;
}

TEST(OffloadDelta, OffloadedOracleTopKGivesTheLocalTokensWithFewerBytes) {
  ModelLoadOptions load;
  auto model = CpuModel::Load(kModel, load);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig config = (*model)->config();
  // A stop id the local run never emits, so that all 64 tokens come.
  GreedyRun local;
  int stop = config.vocab_size - 1;
  for (; stop >= config.vocab_size - 8; --stop) {
    local = Greedy(nullptr, stop);
    if (local.tokens.size() == 64u) break;
  }
  ASSERT_EQ(local.tokens.size(), 64u);

  uint64_t received[2] = {0, 0};  // full replies, delta replies
  for (const bool deltas : {false, true}) {
    SCOPED_TRACE(deltas ? "delta replies" : "full replies");
    std::unique_ptr<ColocatedCacheRank> cache = MakeCache(config, deltas);
    ASSERT_NE(cache, nullptr);
    const GreedyRun offloaded = Greedy(cache.get(), stop);
    EXPECT_EQ(offloaded.tokens, local.tokens);
    const CacheRankClient& client = cache->client();
    EXPECT_EQ(client.delta_replies(), deltas);
    received[deltas ? 1 : 0] = client.bytes_received();
    EXPECT_GT(client.compact_rows_full(), 0u);
    if (deltas) {
      // Entering rows only: fewer than every selected row, and fewer bytes than full replies
      // (whose bytes the client also counts).
      EXPECT_LT(client.compact_rows_received(), client.compact_rows_full());
      EXPECT_LT(client.bytes_received(), client.full_reply_bytes());
      EXPECT_NE(
          offloaded.stats.find(" delta_replies=1 compact_rows_received=" +
                               std::to_string(client.compact_rows_received()) +
                               " compact_rows_full=" + std::to_string(client.compact_rows_full())),
          std::string::npos)
          << offloaded.stats;
    } else {
      EXPECT_EQ(client.compact_rows_received(), client.compact_rows_full());
      EXPECT_EQ(client.bytes_received(), client.full_reply_bytes());
      EXPECT_NE(offloaded.stats.find(" delta_replies=0 "), std::string::npos) << offloaded.stats;
    }
    EXPECT_EQ(cache->service().Stats().store.sessions_open, 0u);
  }
  EXPECT_LT(received[1], received[0]) << "delta replies against full replies";
}

}  // namespace
}  // namespace rubato
