// AsyncSpade through the engine and the colocated cache rank (the same client, packs, service and
// replies as two processes): with a selection covering the context the greedy tokens equal local
// dense's; a small selection runs with delta replies and its stats line carries the prediction
// counters; other residencies and bad config values are refused by name; and an inference rank
// slower than the cache rank never waits (the replies for step t + 1 were made from step t's
// queries while it computed). Narrative: docs/asyncspade.md.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/config.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/policies/asyncspade/asyncspade_policy.h"
#include "inference_rank/policies/policy_registry.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"

namespace rubato {
namespace {

constexpr char kModel[] = "models/tiny-qwen3-longctx";
constexpr int kNewTokens = 24;

struct GreedyRun {
  std::vector<int> tokens;
  std::string stats;
};

std::unique_ptr<ColocatedCacheRank> MakeCache(const ModelConfig& model,
                                              const CacheSelectorSpec& selection,
                                              bool deltas = true) {
  CacheClientOptions client;
  client.delta_replies = deltas;
  client.selection = selection;
  client.pack_layers = 1;  // the policy's pack_layers wins when set
  CacheServiceOptions service;
  service.budget_bytes = uint64_t{64} << 20;
  auto cache = ColocatedCacheRank::Create(model, client, service);
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return cache.ok() ? std::move(cache).value() : nullptr;
}

// Greedy tokens of a fixed 29-token prompt under `policy`, offloaded through `cache` or
// `residency` when set.
GreedyRun Greedy(std::shared_ptr<AttentionPolicy> policy, ColocatedCacheRank* cache,
                 std::shared_ptr<OffloadedResidency> residency = nullptr) {
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
  options.policy = std::move(policy);
  if (cache != nullptr) {
    residency = std::make_shared<OffloadedResidency>(cache->client(), &cache->client());
  }
  options.residency = residency;
  auto engine = Engine::Create(std::unique_ptr<Model>(std::move(model).value()), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  GenerationRequest request;
  for (int i = 0; i < 29; ++i) request.prompt_ids.push_back((i * 131 + 7) % vocab);
  request.max_new_tokens = kNewTokens;
  request.stop_token_ids = {vocab - 1};
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

ModelConfig TinyConfig() {
  ModelLoadOptions load;
  auto model = CpuModel::Load(kModel, load);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return model.ok() ? (*model)->config() : ModelConfig{};
}

TEST(AsyncSpade, ASelectionCoveringTheContextGivesTheDenseTokens) {
  const GreedyRun dense = Greedy(nullptr, nullptr);
  ASSERT_FALSE(dense.tokens.empty());
  // Two dense warm-up steps, then every step attends the predicted selection (all of it).
  const AsyncSpadeConfig config{.top_k = 128,
                                .sink_tokens = 4,
                                .recent_window = 8,
                                .query_window = 4,
                                .dense_steps = 2,
                                .pack_layers = 2};
  auto policy = std::make_shared<AsyncSpadePolicy>(config);
  auto spec = policy->MakeCacheSelector();
  ASSERT_TRUE(spec.ok());
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(TinyConfig(), *spec);
  ASSERT_NE(cache, nullptr);
  const GreedyRun offloaded = Greedy(policy, cache.get());
  EXPECT_EQ(offloaded.tokens, dense.tokens);
  EXPECT_EQ(cache->client().pack_layers(), 2);
  EXPECT_GT(cache->client().compact_rows_received(), 0u);
  EXPECT_EQ(cache->service().Stats().store.sessions_open, 0u);
}

TEST(AsyncSpade, ASmallSelectionRunsWithDeltasAndCountsItsPredictions) {
  const AsyncSpadeConfig config{.top_k = 8,
                                .sink_tokens = 4,
                                .recent_window = 8,
                                .query_window = 16,
                                .dense_steps = 4,
                                .pack_layers = 3,
                                .overlap_every = 1};
  auto policy = std::make_shared<AsyncSpadePolicy>(config);
  auto spec = policy->MakeCacheSelector();
  ASSERT_TRUE(spec.ok());
  // The colocated cache rank as `rubato generate` makes it, so the stats line has its counters.
  auto target = ConnectOffload(DefaultConfig(), *spec, TinyConfig());
  ASSERT_TRUE(target.ok()) << target.status().ToString();
  auto residency = std::make_shared<OffloadedResidency>(std::move(target).value());
  const GreedyRun run = Greedy(policy, nullptr, residency);
  EXPECT_FALSE(run.tokens.empty());
  const CacheRankClient& client = *residency->data_client();
  EXPECT_TRUE(client.delta_replies());
  EXPECT_EQ(client.pack_layers(), 3);
  EXPECT_LT(client.bytes_received(), client.full_reply_bytes());
  EXPECT_NE(run.stats.find(" prediction_cosine=0."), std::string::npos) << run.stats;
  EXPECT_NE(run.stats.find(" prediction_overlap="), std::string::npos) << run.stats;
  EXPECT_NE(run.stats.find(" step_wait_ms="), std::string::npos) << run.stats;
}

Result<PolicyChoice> Resolve(const std::string& yaml, std::optional<KvResidency> residency) {
  auto config = ParseConfig(yaml, "p.yaml");
  if (!config.ok()) return config.status();
  return ResolvePolicy(config->policy, residency);
}

// The share the engine reports: the whole context during the warm-up, then sink + C + recent.
TEST(AsyncSpade, ReportsWhatItsSelectionKeeps) {
  AsyncSpadeConfig config;
  config.top_k = 100;
  config.sink_tokens = 4;
  config.recent_window = 16;
  config.dense_steps = 2;
  AsyncSpadePolicy policy(config);
  std::unique_ptr<PolicyRequest> request = policy.Admit(KvResidency::kOffloaded);
  ASSERT_NE(request, nullptr);
  EXPECT_EQ(request->PlanPrefill(0, 1000, true), nullptr);  // the residency attends
  EXPECT_EQ(request->PlanDecode(1000), nullptr);
  EXPECT_EQ(request->Observe(false, 7, -1.f), PolicyRequest::Verdict::kAccept);
  EXPECT_DOUBLE_EQ(request->RetainedKvRatio(1000), 1.0);  // the prompt's token
  request->Observe(true, 7, -1.f);
  request->Observe(true, 7, -1.f);
  EXPECT_DOUBLE_EQ(request->RetainedKvRatio(1002), 1.0);  // still warming up
  request->Observe(true, 7, -1.f);
  EXPECT_DOUBLE_EQ(request->RetainedKvRatio(1003), 120.0 / 1003);
  EXPECT_DOUBLE_EQ(request->RetainedKvRatio(100), 1.0);  // C covers a short context
  request->Observe(false, 7, -1.f);                      // a new prompt: warming up again
  EXPECT_DOUBLE_EQ(request->RetainedKvRatio(1003), 1.0);
}

TEST(AsyncSpade, NeedsOffloadedKvAndRefusesBadValuesByName) {
  auto choice = Resolve("policy:\n  name: asyncspade\n", std::nullopt);
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->residency, KvResidency::kOffloaded);  // its only one
  ASSERT_TRUE(choice->offload.has_value());
  EXPECT_EQ(choice->offload->name, "asyncspade");
  EXPECT_EQ(choice->offload->top_k, 2048);  // the paper's C
  EXPECT_EQ(choice->offload->query_window, 16);
  EXPECT_EQ(choice->offload->dense_steps, 16);
  for (const KvResidency residency : {KvResidency::kLocal, KvResidency::kEvicting}) {
    auto refused = Resolve("policy:\n  name: asyncspade\n", residency);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().message(), "policy 'asyncspade' does not support " +
                                              std::string(KvResidencyName(residency)) +
                                              " KV (supported: offloaded)");
  }
  const std::pair<const char*, const char*> bad[] = {
      {"top_k: 0", "p.yaml: policy.top_k"},
      {"query_window: 0", "p.yaml: policy.query_window"},
      {"query_window: 65", "p.yaml: policy.query_window"},
      {"ridge_lambda: 0", "p.yaml: policy.ridge_lambda"},
      {"dense_steps: -1", "p.yaml: policy.dense_steps"},
      {"pack_layers: 2000", "p.yaml: policy.pack_layers"},
      {"overlap_every: -1", "p.yaml: policy.overlap_every"},
      {"window: 16", "p.yaml: policy.window"},
  };
  for (const auto& [line, key] : bad) {
    auto refused = Resolve(std::string("policy:\n  name: asyncspade\n  ") + line + "\n",
                           KvResidency::kOffloaded);
    ASSERT_FALSE(refused.ok()) << line;
    EXPECT_NE(refused.status().message().find(key), std::string::npos)
        << line << ": " << refused.status().message();
  }
}

// The client driven by hand with an inference rank that, after each step, waits until the cache
// rank has posted every reply (a slow forward): no reply is ever late, so nothing is waited for.
TEST(AsyncSpade, ASlowInferenceRankNeverWaitsForAReply) {
  ModelConfig model;
  model.num_layers = 6;
  model.num_heads = 4;
  model.num_kv_heads = 2;
  model.head_dim = 8;
  CacheSelectorSpec spec;
  spec.name = "asyncspade";
  spec.top_k = 6;
  spec.sink_tokens = 2;
  spec.recent_tokens = 4;
  spec.dense_steps = 1;
  spec.pack_layers = 2;
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(model, spec);
  ASSERT_NE(cache, nullptr);
  CacheRankClient& client = cache->client();
  ASSERT_EQ(client.pack_layers(), 2);
  auto session = client.OpenSession(1, 64);
  ASSERT_TRUE(session.ok()) << session.status().ToString();

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  uint64_t packs = 0;
  int position = 0;
  for (int step = 0; step < 12; ++step) {
    const int tokens = step == 0 ? 20 : 1;
    std::vector<float> k(size_t(tokens) * model.kv_dim()), v(k.size()), q(model.q_dim());
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (float& x : k) x = normal(rng);
      for (float& x : v) x = normal(rng);
      for (float& x : q) x = normal(rng);
      const OffloadLayerKv entry{*session, position, tokens, k.data(), v.data(), q.data()};
      ASSERT_TRUE(client.LayerComputed(layer, {&entry, 1}).ok());
      if (tokens == 1) {  // the decode token reads the rows selected for it one step ago
        auto compact = client.CompactFor(layer, *session, position);
        ASSERT_TRUE(compact.ok()) << compact.status().ToString();
        EXPECT_EQ(compact->recent_begin, step <= spec.dense_steps ? 0 : position + 1 - 4);
      }
    }
    packs += 3;
    position += tokens;
    // The slow forward: the cache rank has answered every pack before the next step begins.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (cache->service().Stats().replies_posted < packs &&
           std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(cache->service().Stats().replies_posted, packs);
  }
  EXPECT_EQ(client.waits_blocked(), 0u);
  EXPECT_EQ(client.pack_wait_seconds(), 0.0);
  EXPECT_TRUE(client.CloseSession(*session).ok());
}

}  // namespace
}  // namespace rubato
