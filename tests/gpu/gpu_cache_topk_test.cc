// oracle_topk on a GPU cache rank of this process (gpu_cache_topk.h: the cache GPU selects and
// sends the rows entering each selection into compact pools on the model GPU) against local
// oracle_topk on the CUDA engine: the greedy tokens agree up to near-ties, with delta replies and
// with full ones. The pools are attended in slot order where local oracle_topk attends its
// gathered rows in position order, and the cache GPU scores with decode_scores where local
// oracle_topk takes the dense pass's scores, so a near-tied choice may swap: every divergence is
// listed with local oracle_topk's top-2 logit margin there, which must be within 4x the largest
// |offloaded - local| logit difference (cuda_model_offload_test.cc's rule). The cache GPU is the
// second device when there is one, else the model's own. A small variant runs under memcheck.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_test;

constexpr int kMaxContext = 1024;

void ExpectOk(const Status& status) { EXPECT_TRUE(status.ok()) << status.message(); }
constexpr int kPrefillChunk = 128;

std::string Config() {
  return SmallConfigJson("Qwen3ForCausalLM", 256, 8, 2, 64, 512, 2, 300, true);
}

// q/k-norm weights scaled so that attention is peaked and a selection is decided by margins above
// bf16 rounding (cuda_oracle_topk_test.cc's SharpModelPair).
std::unique_ptr<Model> SharpModel(uint64_t seed) {
  ModelPair pair = MakeModelPair(Config(), seed, /*use_cuda_graph=*/true, [](ModelWeights& w) {
    for (LayerWeights& layer : w.layers) {
      for (float& x : layer.q_norm) x *= 2.0f;
      for (float& x : layer.k_norm) x *= 2.0f;
    }
  });
  return std::move(pair.cuda);
}

std::shared_ptr<GpuCacheResidency> GpuCache(bool delta_replies) {
  int devices = 0;
  EXPECT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  CacheSection section;
  section.memory = CacheSection::Memory::kDevice;
  section.device = devices > 1 ? 1 : 0;
  section.budget_gib = 0.25;
  auto residency = std::make_shared<GpuCacheResidency>(section, kMaxContext, 3 + kPrefillChunk);
  residency->set_delta_replies(delta_replies);
  return residency;
}

std::vector<std::vector<int>> Generate(uint64_t seed, const OracleTopKConfig& config,
                                       std::shared_ptr<Residency> residency,
                                       const std::vector<std::vector<int>>& prompts) {
  EngineOptions options;
  options.max_batch = 3;
  options.max_context = kMaxContext;
  options.block_size = 16;
  options.prefill_chunk = kPrefillChunk;
  options.policy = std::make_shared<OracleTopKPolicy>(config);
  options.residency = std::move(residency);
  return EngineGreedyTokens(SharpModel(seed), options, prompts);
}

// Last-row logits of every step of one request: `prompt` prefilled in chunks, then `forced` fed
// one token at a time; local oracle_topk (the policy's backend and plans) or, with `residency`,
// offloaded to its GPU cache rank. [steps][vocab].
std::vector<std::vector<float>> TeacherForced(uint64_t seed, const OracleTopKConfig& config,
                                              GpuCacheResidency* residency,
                                              const std::vector<int>& prompt,
                                              const std::vector<int>& forced) {
  std::unique_ptr<Model> model = SharpModel(seed);
  OracleTopKPolicy policy(config);
  const int total = static_cast<int>(prompt.size() + forced.size());
  auto cache = NewCache(*model, 16, total / 16 + 2);
  KvSequence sequence;
  std::unique_ptr<PolicyRequest> planned;
  std::unique_ptr<ResidencyRequest> offloaded;
  if (residency != nullptr) {
    ExpectOk(residency->Attach(*model, &policy, 1));
    auto opened = residency->Open(1, total - 1);
    EXPECT_TRUE(opened.ok()) << opened.status().message();
    if (!opened.ok()) return {};
    offloaded = std::move(*opened);
  } else {
    auto backend = policy.MakeBackend(*model, 1);
    EXPECT_TRUE(backend.ok()) << backend.status().message();
    if (!backend.ok()) return {};
    ExpectOk(model->SetAttentionBackend(std::move(backend).value()));
    planned = policy.Admit(KvResidency::kLocal);
  }
  std::vector<std::vector<float>> rows;
  ForwardResult result;
  const auto feed = [&](std::span<const int> tokens, int start, bool want, bool decode) {
    ForwardEntry entry{&sequence, tokens, start, want ? LogitsWanted::kLast : LogitsWanted::kNone};
    if (offloaded != nullptr) offloaded->AttachTo(entry);
    if (planned != nullptr && decode) entry.attention = planned->PlanDecode(start);
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
              begin + n == prompt.size(), false)) {
      return {};
    }
  }
  for (size_t i = 0; i < forced.size(); ++i) {
    if (!feed(std::span(forced).subspan(i, 1), static_cast<int>(prompt.size() + i), true, true)) {
      return {};
    }
  }
  if (offloaded != nullptr) ExpectOk(residency->Close(*offloaded));
  return rows;
}

// Offloaded tokens equal local ones up to near-ties (each divergence listed with its margin).
void ExpectSameTokensUpToNearTies(const char* what, uint64_t seed, const OracleTopKConfig& config,
                                  bool delta_replies, const std::vector<std::vector<int>>& prompts,
                                  const std::vector<std::vector<int>>& local,
                                  const std::vector<std::vector<int>>& offloaded) {
  ASSERT_EQ(offloaded.size(), local.size());
  for (size_t r = 0; r < local.size(); ++r) {
    const std::vector<int>& a = local[r];
    const std::vector<int>& b = offloaded[r];
    ASSERT_FALSE(a.empty());
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
    std::printf(
        "[ topk-gpu  ] %s request %zu: %zu local tokens, %zu offloaded, identical for %zu\n", what,
        r, a.size(), b.size(), k);
    if (k == a.size() && k == b.size()) continue;
    ASSERT_TRUE(k < a.size() && k < b.size()) << "one run stopped early without diverging";
    const std::vector<int> forced(a.begin(), a.begin() + static_cast<ptrdiff_t>(k));
    const auto local_rows = TeacherForced(seed, config, nullptr, prompts[r], forced);
    std::shared_ptr<GpuCacheResidency> gpu = GpuCache(delta_replies);
    const auto offload_rows = TeacherForced(seed, config, gpu.get(), prompts[r], forced);
    ASSERT_EQ(local_rows.size(), k + 1);
    ASSERT_EQ(offload_rows.size(), k + 1);
    const double margin = Top2Margin(local_rows[k]);
    const double diff = MaxAbsDiff(offload_rows[k], local_rows[k]);
    std::printf(
        "[ topk-gpu  ] %s request %zu diverges at token %zu: local %d, offloaded %d, local top-2 "
        "margin %.4g, max |offloaded - local| logit %.4g\n",
        what, r, k, a[k], b[k], margin, diff);
    EXPECT_LE(margin, 4 * diff) << what << " request " << r << ": tokens diverge at " << k
                                << " although local oracle_topk's choice was clear";
  }
}

TEST(GpuCacheTopK, OffloadedOracleTopKGivesTheLocalTokensUpToNearTies) {
  OracleTopKConfig config;
  config.top_k = 32;
  config.sink_tokens = 4;
  config.recent_window = 16;
  constexpr uint64_t kSeed = 21;
  std::mt19937_64 rng(5);
  const int vocab = 300;
  const std::vector<std::vector<int>> prompts = {
      RandomTokens(rng, 600, vocab), RandomTokens(rng, 333, vocab), RandomTokens(rng, 901, vocab)};
  const auto local = Generate(kSeed, config, nullptr, prompts);
  ASSERT_EQ(local.size(), prompts.size());
  for (const bool deltas : {true, false}) {
    std::shared_ptr<GpuCacheResidency> gpu = GpuCache(deltas);
    const auto offloaded = Generate(kSeed, config, gpu, prompts);
    ASSERT_NE(gpu->topk(), nullptr) << "the residency did not take the top-k path";
    const GpuCacheTopKBytes& bytes = gpu->topk()->totals();
    std::printf("[ topk-gpu  ] deltas %d:%s\n", deltas ? 1 : 0, gpu->StatsLine().c_str());
    ExpectSameTokensUpToNearTies(deltas ? "deltas" : "full replies", kSeed, config, deltas, prompts,
                                 local, offloaded);
    EXPECT_GT(gpu->topk()->steps(), 0u);
    EXPECT_GT(bytes.rows_full, 0u);
    if (deltas) {
      EXPECT_LT(bytes.rows_back, bytes.rows_full) << "deltas carried every selected row";
      EXPECT_LT(bytes.back, bytes.full_back);
    } else {
      EXPECT_EQ(bytes.rows_back, bytes.rows_full) << "full replies carry every selected row";
    }
  }
}

// The same path small enough for compute-sanitizer (memcheck): one request, a short prompt.
TEST(GpuCacheTopK, SmallRunForMemcheck) {
  OracleTopKConfig config;
  config.top_k = 8;
  config.sink_tokens = 2;
  config.recent_window = 8;
  constexpr uint64_t kSeed = 7;
  std::mt19937_64 rng(3);
  const std::vector<std::vector<int>> prompts = {RandomTokens(rng, 150, 300)};
  const auto local = Generate(kSeed, config, nullptr, prompts);
  std::shared_ptr<GpuCacheResidency> gpu = GpuCache(true);
  const auto offloaded = Generate(kSeed, config, gpu, prompts);
  ASSERT_NE(gpu->topk(), nullptr);
  ExpectSameTokensUpToNearTies("memcheck", kSeed, config, true, prompts, local, offloaded);
}

}  // namespace
}  // namespace rubato
