// Dense attention on the cache rank (the `attention` selector), through the engine and the
// colocated cache rank (the same client, packs, service and replies as two processes): 64
// greedy tokens equal local dense's on the golden checkpoints and the trained
// tiny-qwen3-longctx; a decode step's bytes, each way, do not grow with the context; offloaded
// oracle_topk with top_k covering the context still gives the local tokens; the client's and
// the cache rank's counters move. Narrative: docs/disaggregated.md "Attention on the cache rank".
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "inference_rank/engine/engine.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"
#include "tests/golden_reference.h"

namespace rubato {
namespace {

struct Checkpoint {
  std::string dir;     // model directory, relative to the source root
  std::string golden;  // tests/data/golden/<golden>'s prompt, or empty: a fixed prompt
};

const Checkpoint kCheckpoints[] = {
    {"models/tiny-qwen3-random", "tiny-qwen3-random"},
    {"tests/data/models/tiny-llama3-random", "tiny-llama3-random"},
    {"tests/data/models/tiny-qwen2-random", "tiny-qwen2-random"},
    {"models/tiny-qwen3-longctx", ""},
};

std::unique_ptr<Model> Load(const std::string& dir) {
  ModelLoadOptions options;
  options.num_threads = 2;
  auto model = CpuModel::Load(dir, options);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return model.ok() ? std::unique_ptr<Model>(std::move(model).value()) : nullptr;
}

std::vector<int> PromptOf(const Checkpoint& checkpoint, int vocab) {
  if (!checkpoint.golden.empty()) return golden::LoadGoldenReference(checkpoint.golden).prompt_ids;
  std::vector<int> ids;
  for (int i = 0; i < 29; ++i) ids.push_back((i * 131 + 7) % vocab);
  return ids;
}

std::unique_ptr<ColocatedCacheRank> MakeCache(const ModelConfig& model,
                                              const CacheClientOptions& client) {
  CacheServiceOptions service;
  service.budget_bytes = uint64_t{256} << 20;
  auto cache = ColocatedCacheRank::Create(model, client, service);
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return cache.ok() ? std::move(cache).value() : nullptr;
}

// `max_new_tokens` greedy tokens of `prompt` that stop at `stop` only, offloaded through
// `cache` when set.
std::vector<int> Greedy(const std::string& dir, const std::vector<int>& prompt, int max_new_tokens,
                        int stop, ColocatedCacheRank* cache) {
  std::unique_ptr<Model> model = Load(dir);
  if (model == nullptr) return {};
  EngineOptions options;
  options.max_batch = 2;
  options.max_context = 512;  // the golden prompts have up to 246 tokens
  options.prefill_chunk = 64;
  options.num_threads = 2;
  if (cache != nullptr) {
    options.residency = std::make_shared<OffloadedResidency>(cache->client(), &cache->client());
  }
  auto engine = Engine::Create(std::move(model), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  GenerationRequest request;
  request.prompt_ids = prompt;
  request.max_new_tokens = max_new_tokens;
  request.stop_token_ids = {stop};
  request.sampling.temperature = 0.0f;
  EXPECT_TRUE((*engine)->Submit(request).ok());
  std::vector<int> tokens;
  while ((*engine)->HasWork()) {
    auto events = (*engine)->Step();
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      EXPECT_NE(event.finish, FinishReason::kError) << event.error.message();
      if (event.finish != FinishReason::kError) tokens.push_back(event.token);
    }
  }
  return tokens;
}

// Local dense's `count` greedy tokens and the stop id that let all of them come: the highest
// id they do not contain (found by trying ids from the vocabulary's last down).
std::pair<std::vector<int>, int> LocalGreedy(const std::string& dir, const std::vector<int>& prompt,
                                             int count, int vocab) {
  std::vector<int> tokens;
  for (int stop = vocab - 1; stop >= vocab - 8; --stop) {
    tokens = Greedy(dir, prompt, count, stop, nullptr);
    if (static_cast<int>(tokens.size()) == count) return {tokens, stop};
  }
  ADD_FAILURE() << dir << ": every stop id tried ended the greedy tokens early";
  return {tokens, vocab - 1};
}

TEST(OffloadAttention, DenseOnTheCacheRankGivesTheLocalGreedyTokens) {
  for (const Checkpoint& checkpoint : kCheckpoints) {
    SCOPED_TRACE(checkpoint.dir);
    std::unique_ptr<Model> model = Load(checkpoint.dir);
    ASSERT_NE(model, nullptr);
    const std::vector<int> prompt = PromptOf(checkpoint, model->config().vocab_size);
    const auto [local, stop] = LocalGreedy(checkpoint.dir, prompt, 64, model->config().vocab_size);
    ASSERT_EQ(local.size(), 64u);
    std::unique_ptr<ColocatedCacheRank> cache = MakeCache(model->config(), CacheClientOptions());
    ASSERT_NE(cache, nullptr);
    EXPECT_EQ(Greedy(checkpoint.dir, prompt, 64, stop, cache.get()), local);
    // Every decode step's reply was the attention (no rows): the cache rank answered one pack
    // per layer and step, and the session is closed.
    const CacheServiceStats stats = cache->service().Stats();
    EXPECT_EQ(stats.packs_received % static_cast<uint64_t>(model->config().num_layers), 0u);
    EXPECT_EQ(stats.store.gathered_rows, 0u) << "no K/V row went back to the inference rank";
    EXPECT_GT(stats.selection_seconds, 0.0);
    EXPECT_EQ(stats.store.sessions_open, 0u);
  }
}

TEST(OffloadAttention, OracleTopKCoveringTheContextStillGivesTheLocalTokens) {
  const Checkpoint& longctx = kCheckpoints[3];
  std::unique_ptr<Model> model = Load(longctx.dir);
  ASSERT_NE(model, nullptr);
  const std::vector<int> prompt = PromptOf(longctx, model->config().vocab_size);
  const auto [local, stop] = LocalGreedy(longctx.dir, prompt, 32, model->config().vocab_size);
  CacheClientOptions client;
  client.selection = {.name = "oracle_topk", .top_k = 256, .sink_tokens = 4, .recent_tokens = 8};
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(model->config(), client);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(Greedy(longctx.dir, prompt, 32, stop, cache.get()), local);
  EXPECT_GT(cache->service().Stats().store.gathered_rows, 0u) << "oracle_topk replies rows";
}

// A bf16 wire (the CUDA model's dtype) under the CPU model's f32 K/V: the client narrows, the
// cache rank stores and attends bf16; half the bytes appended, and the run ends as asked.
TEST(OffloadAttention, ABf16WireCarriesHalfTheBytes) {
  const Checkpoint& longctx = kCheckpoints[3];
  std::unique_ptr<Model> model = Load(longctx.dir);
  ASSERT_NE(model, nullptr);
  const std::vector<int> prompt = PromptOf(longctx, model->config().vocab_size);
  const auto [local, stop] = LocalGreedy(longctx.dir, prompt, 16, model->config().vocab_size);
  uint64_t appended[2] = {0, 0};
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    CacheClientOptions client;
    client.kv_dtype = dtype;
    std::unique_ptr<ColocatedCacheRank> cache = MakeCache(model->config(), client);
    ASSERT_NE(cache, nullptr);
    EXPECT_EQ(cache->client().kv_dtype(), dtype);
    const std::vector<int> tokens = Greedy(longctx.dir, prompt, 16, stop, cache.get());
    EXPECT_EQ(tokens.size(), 16u) << DTypeName(dtype);
    if (dtype == DType::kF32) {
      EXPECT_EQ(tokens, local);
    }
    appended[dtype == DType::kF32 ? 0 : 1] = cache->service().Stats().store.bytes_appended;
  }
  EXPECT_GT(appended[1], 0u);
  EXPECT_EQ(appended[0], 2 * appended[1]);
}

// The bytes of one decode step, each way, at two context lengths: equal (attention replies are
// the output and log-sum-exp of the query, whatever the context holds).
TEST(OffloadAttention, BytesPerStepDoNotGrowWithTheContext) {
  const Checkpoint& longctx = kCheckpoints[3];
  std::unique_ptr<Model> model = Load(longctx.dir);
  ASSERT_NE(model, nullptr);
  const ModelConfig config = model->config();
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(config, CacheClientOptions());
  ASSERT_NE(cache, nullptr);
  EngineOptions options;
  options.max_batch = 1;
  options.max_context = 256;
  options.num_threads = 2;
  options.residency = std::make_shared<OffloadedResidency>(cache->client(), &cache->client());
  auto engine = Engine::Create(std::move(model), options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  GenerationRequest request;
  request.prompt_ids = PromptOf(longctx, config.vocab_size);
  request.max_new_tokens = 120;
  request.stop_token_ids = {config.vocab_size - 1};
  ASSERT_TRUE((*engine)->Submit(request).ok());
  const CacheRankClient& client = cache->client();
  ASSERT_TRUE((*engine)->Step().ok());  // the prefill (29 tokens, one chunk) and token 1
  std::vector<std::pair<uint64_t, uint64_t>> per_step;  // (sent, received) of decode steps
  for (int step = 0; step < 100; ++step) {
    const uint64_t sent = client.bytes_sent();
    const uint64_t received = client.bytes_received();
    auto events = (*engine)->Step();
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    ASSERT_EQ(events->size(), 1u);
    per_step.emplace_back(client.bytes_sent() - sent, client.bytes_received() - received);
  }
  // Context 30 against 129: the same bytes both ways.
  EXPECT_GT(per_step.front().second, 0u);
  EXPECT_EQ(per_step.front(), per_step.back());
  // One KV pack (64-byte header announcing it, then the pack) and one reply per layer; the
  // reply holds the f32 output and log-sum-exp of every query head.
  const uint64_t output_bytes = uint64_t{4} * config.num_heads * (config.head_dim + 1);
  EXPECT_GE(per_step.back().second, config.num_layers * output_bytes);
  EXPECT_LT(per_step.back().second, config.num_layers * (output_bytes + 256));
}

}  // namespace
}  // namespace rubato
