// AsyncSpade on a GPU cache rank of this process (gpu_cache_topk.h with predict: query rings
// and the predictor on the cache GPU, the selection one step ahead with the predicted query, its
// pack scattered into the pools after each layer's attention on a side stream) against local
// dense on the CUDA engine. With C covering the context every position is attended (the pools
// hold every position below the recent window, whatever the prediction), so the greedy tokens
// equal dense's up to near ties: the pools are attended in slot order and in two segments where
// dense attends the paged cache in one pass, so a near-tied choice may swap; every divergence is
// listed with dense's top-2 logit margin there, which must be within 4x the largest |asyncspade
// - dense| logit difference (gpu_cache_topk_test.cc's rule). Steps run ahead once the warm-up is
// over (counted), the exposed wait is timed, and a small C runs with delta replies. The cache GPU
// is the second device when there is one. A small variant runs under memcheck.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "inference_rank/policies/asyncspade/asyncspade_policy.h"
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_test;

constexpr int kMaxContext = 1024;
constexpr int kPrefillChunk = 128;

void ExpectOk(const Status& status) { EXPECT_TRUE(status.ok()) << status.message(); }

std::string Config() {
  return SmallConfigJson("Qwen3ForCausalLM", 256, 8, 2, 64, 512, 2, 300, true);
}

// q/k-norm weights scaled so that attention is peaked (gpu_cache_topk_test.cc's SharpModel).
std::unique_ptr<Model> SharpModel(uint64_t seed) {
  ModelPair pair = MakeModelPair(Config(), seed, /*use_cuda_graph=*/true, [](ModelWeights& w) {
    for (LayerWeights& layer : w.layers) {
      for (float& x : layer.q_norm) x *= 2.0f;
      for (float& x : layer.k_norm) x *= 2.0f;
    }
  });
  return std::move(pair.cuda);
}

std::shared_ptr<GpuCacheResidency> GpuCache() {
  int devices = 0;
  EXPECT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  CacheSection section;
  section.memory = CacheSection::Memory::kDevice;
  section.device = devices > 1 ? 1 : 0;
  section.budget_gib = 0.25;
  return std::make_shared<GpuCacheResidency>(section, kMaxContext, 3 + kPrefillChunk);
}

// AsyncSpade's greedy tokens through the GPU cache rank, or (no config) local dense's; with
// `ignore_eos` each request runs its 40 tokens whatever it samples.
std::vector<std::vector<int>> Generate(uint64_t seed, const AsyncSpadeConfig* config,
                                       std::shared_ptr<Residency> residency,
                                       const std::vector<std::vector<int>>& prompts,
                                       bool ignore_eos = false) {
  EngineOptions options;
  options.max_batch = 3;
  options.max_context = kMaxContext;
  options.block_size = 16;
  options.prefill_chunk = kPrefillChunk;
  if (config != nullptr) options.policy = std::make_shared<AsyncSpadePolicy>(*config);
  options.residency = std::move(residency);
  return EngineGreedyTokens(SharpModel(seed), options, prompts, nullptr, ignore_eos);
}

// Last-row logits of every step of one request: `prompt` prefilled in chunks, then `forced` fed
// one token at a time; local dense, or with `residency` asyncspade on its GPU cache rank.
std::vector<std::vector<float>> TeacherForced(uint64_t seed, const AsyncSpadeConfig& config,
                                              GpuCacheResidency* residency,
                                              const std::vector<int>& prompt,
                                              const std::vector<int>& forced) {
  std::unique_ptr<Model> model = SharpModel(seed);
  AsyncSpadePolicy policy(config);
  const int total = static_cast<int>(prompt.size() + forced.size());
  auto cache = NewCache(*model, 16, total / 16 + 2);
  KvSequence sequence;
  std::unique_ptr<ResidencyRequest> offloaded;
  if (residency != nullptr) {
    ExpectOk(residency->Attach(*model, &policy, 1));
    auto opened = residency->Open(1, total - 1);
    EXPECT_TRUE(opened.ok()) << opened.status().message();
    if (!opened.ok()) return {};
    offloaded = std::move(*opened);
  }
  std::vector<std::vector<float>> rows;
  ForwardResult result;
  const auto feed = [&](std::span<const int> tokens, int start, bool want) {
    ForwardEntry entry{&sequence, tokens, start, want ? LogitsWanted::kLast : LogitsWanted::kNone};
    if (offloaded != nullptr) offloaded->AttachTo(entry);
    const Status status = model->Forward({&entry, 1}, *cache, result);
    EXPECT_TRUE(status.ok()) << status.message();
    if (status.ok() && want) {
      const auto row = result.EntryLogits(0);
      rows.emplace_back(row.begin(), row.end());
    }
    return status.ok();
  };
  for (size_t begin = 0; begin < prompt.size(); begin += kPrefillChunk) {
    const size_t n = std::min<size_t>(kPrefillChunk, prompt.size() - begin);
    if (!feed(std::span(prompt).subspan(begin, n), static_cast<int>(begin),
              begin + n == prompt.size())) {
      return {};
    }
  }
  for (size_t i = 0; i < forced.size(); ++i) {
    if (!feed(std::span(forced).subspan(i, 1), static_cast<int>(prompt.size() + i), true)) {
      return {};
    }
  }
  if (offloaded != nullptr) ExpectOk(residency->Close(*offloaded));
  return rows;
}

void ExpectDenseTokensUpToNearTies(const char* what, uint64_t seed, const AsyncSpadeConfig& config,
                                   const std::vector<std::vector<int>>& prompts,
                                   const std::vector<std::vector<int>>& dense,
                                   const std::vector<std::vector<int>>& spade) {
  ASSERT_EQ(spade.size(), dense.size());
  for (size_t r = 0; r < dense.size(); ++r) {
    const std::vector<int>& a = dense[r];
    const std::vector<int>& b = spade[r];
    ASSERT_FALSE(a.empty());
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
    std::printf(
        "[ asyncspade ] %s request %zu: %zu dense tokens, %zu asyncspade, identical for "
        "%zu\n",
        what, r, a.size(), b.size(), k);
    if (k == a.size() && k == b.size()) continue;
    ASSERT_TRUE(k < a.size() && k < b.size()) << "one run stopped early without diverging";
    const std::vector<int> forced(a.begin(), a.begin() + static_cast<ptrdiff_t>(k));
    const auto dense_rows = TeacherForced(seed, config, nullptr, prompts[r], forced);
    std::shared_ptr<GpuCacheResidency> gpu = GpuCache();
    const auto spade_rows = TeacherForced(seed, config, gpu.get(), prompts[r], forced);
    ASSERT_EQ(dense_rows.size(), k + 1);
    ASSERT_EQ(spade_rows.size(), k + 1);
    const double margin = Top2Margin(dense_rows[k]);
    const double diff = MaxAbsDiff(spade_rows[k], dense_rows[k]);
    std::printf(
        "[ asyncspade ] %s request %zu diverges at token %zu: dense %d, asyncspade %d, "
        "dense top-2 margin %.4g, max |asyncspade - dense| logit %.4g\n",
        what, r, k, a[k], b[k], margin, diff);
    EXPECT_LE(margin, 4 * diff) << what << " request " << r << ": tokens diverge at " << k
                                << " although dense's choice was clear";
  }
}

TEST(GpuCacheAsyncSpade, SelectionCoveringTheContextGivesDenseTokensUpToNearTies) {
  AsyncSpadeConfig config;
  config.top_k = kMaxContext;  // C >= context: every position below the recent window
  config.sink_tokens = 4;
  config.recent_window = 16;
  config.query_window = 4;
  config.dense_steps = 2;
  constexpr uint64_t kSeed = 21;
  std::mt19937_64 rng(5);
  const int vocab = 300;
  const std::vector<std::vector<int>> prompts = {
      RandomTokens(rng, 600, vocab), RandomTokens(rng, 333, vocab), RandomTokens(rng, 901, vocab)};
  const auto dense = Generate(kSeed, nullptr, nullptr, prompts);
  ASSERT_EQ(dense.size(), prompts.size());
  std::shared_ptr<GpuCacheResidency> gpu = GpuCache();
  const auto spade = Generate(kSeed, &config, gpu, prompts);
  ASSERT_NE(gpu->topk(), nullptr) << "the residency did not take the top-k path";
  std::printf("[ asyncspade ]%s\n", gpu->StatsLine().c_str());
  ExpectDenseTokensUpToNearTies("C >= context", kSeed, config, prompts, dense, spade);
  EXPECT_GT(gpu->topk()->predicted_steps(), 0u) << "no step ran ahead";
  EXPECT_LT(gpu->topk()->predicted_steps(), gpu->topk()->steps()) << "no warm-up step";
  EXPECT_GE(gpu->topk()->total_wait_ms(), 0.0);
  EXPECT_NE(gpu->StatsLine().find("predicted_steps="), std::string::npos);
}

// A small C: runs ahead with delta replies (fewer rows back than full replies would carry); the
// tokens are not compared (the prediction decides the selection).
TEST(GpuCacheAsyncSpade, SmallSelectionRunsAheadWithDeltas) {
  AsyncSpadeConfig config;
  config.top_k = 32;
  config.sink_tokens = 4;
  config.recent_window = 16;
  config.query_window = 16;
  config.dense_steps = 4;
  std::mt19937_64 rng(9);
  const std::vector<std::vector<int>> prompts = {RandomTokens(rng, 700, 300),
                                                 RandomTokens(rng, 500, 300)};
  std::shared_ptr<GpuCacheResidency> gpu = GpuCache();
  // The prediction decides the tokens, which may reach the model's eos early: it is ignored.
  const auto spade = Generate(17, &config, gpu, prompts, /*ignore_eos=*/true);
  ASSERT_NE(gpu->topk(), nullptr);
  for (const auto& tokens : spade) EXPECT_EQ(tokens.size(), 40u);
  const GpuCacheTopKBytes& bytes = gpu->topk()->totals();
  std::printf("[ asyncspade ] small C:%s\n", gpu->StatsLine().c_str());
  EXPECT_GT(gpu->topk()->predicted_steps(), 0u);
  EXPECT_LT(bytes.rows_back, bytes.rows_full) << "deltas carried every selected row";
}

TEST(GpuCacheAsyncSpade, QueryWindowPastTheDevicePredictorIsRefusedByName) {
  AsyncSpadeConfig config;
  config.query_window = 17;
  AsyncSpadePolicy policy(config);
  std::unique_ptr<Model> model = SharpModel(3);
  std::shared_ptr<GpuCacheResidency> gpu = GpuCache();
  const Status status = gpu->Attach(*model, &policy, 1);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("query_window 17"), std::string::npos) << status.message();
}

// The same path small enough for compute-sanitizer (memcheck): one request, a short prompt.
TEST(GpuCacheAsyncSpade, SmallRunForMemcheck) {
  AsyncSpadeConfig config;
  config.top_k = 256;
  config.sink_tokens = 2;
  config.recent_window = 8;
  config.query_window = 3;
  config.dense_steps = 1;
  std::mt19937_64 rng(3);
  const std::vector<std::vector<int>> prompts = {RandomTokens(rng, 150, 300)};
  const auto dense = Generate(7, nullptr, nullptr, prompts);
  std::shared_ptr<GpuCacheResidency> gpu = GpuCache();
  const auto spade = Generate(7, &config, gpu, prompts);
  ASSERT_NE(gpu->topk(), nullptr);
  EXPECT_GT(gpu->topk()->predicted_steps(), 0u);
  ExpectDenseTokensUpToNearTies("memcheck", 7, config, prompts, dense, spade);
}

}  // namespace
}  // namespace rubato
