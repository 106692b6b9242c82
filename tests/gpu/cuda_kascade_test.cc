// Kascade on the CUDA model: with k covering the context the engine gives the dense tokens bit
// for bit (tiled prefill plans such chunks dense); with a small k, teacher-forced decode steps
// through the CUDA backend half (layer 0 dense with scores, anchors' pooled top-k with a per-row
// k, reuse layers' index gather through the head map) stay near the CPU backend half's logits and
// far from dense attention's, and replay as CUDA graphs; tile-sparse prefill chunks select the
// CPU backend's tiles, give its logits and mix with dense chunks in one forward.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <random>
#include <vector>

#include "inference_rank/policies/kascade/kascade_cpu_backend.h"
#include "inference_rank/policies/kascade/kascade_cuda_backend.h"
#include "inference_rank/policies/kascade/kascade_policy.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using namespace cuda_model_test;

constexpr int kLayers = 3;

std::string Config() {
  return SmallConfigJson("Qwen3ForCausalLM", 256, 8, 2, 64, 512, kLayers, 300, true);
}

// Anchors {0, 2}; layer 1 reads anchor 0 with its KV heads swapped.
KascadeCalibration Calibration(const ModelConfig& m) {
  KascadeCalibration c;
  c.model = "test";
  c.num_layers = m.num_layers;
  c.num_heads = m.num_heads;
  c.num_kv_heads = m.num_kv_heads;
  c.head_dim = m.head_dim;
  c.anchors = {0, 2};
  c.importance.assign(m.num_layers, 1.0);
  c.similarity.assign(static_cast<size_t>(m.num_layers) * m.num_layers, 0.5);
  c.head_map = {{0, 1}, {1, 0}, {0, 1}};
  return c;
}

KascadeConfig DenseDecodeConfig(int top_k_min) {
  KascadeConfig config;
  config.prefill = "dense";  // sparse decode only
  config.top_k_min = top_k_min;
  return config;
}

std::vector<std::vector<int>> Prompts(int vocab) {
  std::mt19937_64 rng(17);
  return {RandomTokens(rng, 600, vocab), RandomTokens(rng, 333, vocab),
          RandomTokens(rng, 901, vocab)};
}

TEST(CudaKascade, KCoveringTheContextGivesTheDenseTokens) {
  for (const char* prefill : {"dense", "tiled"}) {
    ModelPair dense = MakeModelPair(Config(), /*seed=*/9);
    ModelPair kascade = MakeModelPair(Config(), /*seed=*/9);
    ASSERT_NE(dense.cuda, nullptr);
    const int vocab = dense.cuda->config().vocab_size;
    const KascadeCalibration calibration = Calibration(dense.cuda->config());
    EngineOptions options;
    options.max_batch = 3;
    const auto dense_tokens = EngineGreedyTokens(std::move(dense.cuda), options, Prompts(vocab));
    KascadeConfig config = DenseDecodeConfig(1 << 20);
    config.prefill = prefill;
    options.policy = std::make_shared<KascadePolicy>(config, calibration);
    const auto kascade_tokens =
        EngineGreedyTokens(std::move(kascade.cuda), options, Prompts(vocab));
    EXPECT_EQ(kascade_tokens, dense_tokens) << "prefill: " << prefill;
  }
}

TEST(CudaKascade, PrefillTileNotAMultipleOf64IsRefusedByName) {
  ModelPair pair = MakeModelPair(Config(), 3);
  ASSERT_NE(pair.cuda, nullptr);
  KascadeConfig tiled;  // prefill: tiled by default
  tiled.prefill_tile = 100;
  KascadePolicy policy(tiled, Calibration(pair.cuda->config()));
  auto backend = policy.MakeBackend(*pair.cuda, 1);
  EXPECT_TRUE(gpu_test::FailsWith(backend.status(), StatusCode::kUnsupported,
                                  "prefill_tile 100 must be a multiple of 64"));
  tiled.prefill_tile = 128;
  KascadePolicy fine(tiled, Calibration(pair.cuda->config()));
  EXPECT_TRUE(fine.MakeBackend(*pair.cuda, 1).ok());
}

std::vector<float> Steps(Model& model, const std::vector<int>& prompt, int steps,
                         KascadePolicy* policy) {
  auto cache = NewCache(model, 16, 256);
  KvSequence sequence;
  FeedAll(model, *cache, sequence, std::span<const int>(prompt).first(prompt.size() - steps), 0,
          256);
  std::unique_ptr<PolicyRequest> request =
      policy != nullptr ? policy->Admit(KvResidency::kLocal) : nullptr;
  std::vector<float> logits;
  ForwardResult result;
  for (int s = 0; s < steps; ++s) {
    const int position = static_cast<int>(prompt.size()) - steps + s;
    ForwardEntry entry{&sequence, std::span<const int>(prompt).subspan(position, 1), position,
                       LogitsWanted::kLast};
    if (request != nullptr) {
      entry.attention = request->PlanDecode(position);
      EXPECT_NE(entry.attention, nullptr) << "step " << s;
    }
    const Status status = model.Forward({&entry, 1}, *cache, result);
    EXPECT_TRUE(status.ok()) << status.message();
    if (!status.ok()) break;
    const auto row = result.EntryLogits(0);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return logits;
}

// q/k-norm weights scaled so that top-k margins stand far above bf16 rounding (as for oracle).
ModelPair SharpModelPair(double sharpness, uint64_t seed) {
  return MakeModelPair(Config(), seed, /*use_cuda_graph=*/true, [sharpness](ModelWeights& w) {
    for (LayerWeights& layer : w.layers) {
      for (float& x : layer.q_norm) x = static_cast<float>(x * sharpness);
      for (float& x : layer.k_norm) x = static_cast<float>(x * sharpness);
    }
  });
}

struct Distances {
  double to_kascade = 0;  // CUDA Kascade against CPU Kascade
  double to_dense = 0;    // CUDA Kascade against CPU dense
  int64_t graph_replays = 0;
};

// Teacher-forced decode steps of CUDA and CPU Kascade (k = max(ceil(ratio L), 8) of ~700) on the
// same sharpened random model, and of CPU dense.
Distances KascadeDistances(double sharpness, double ratio, const KascadeCalibration& calibration) {
  ModelPair pair = SharpModelPair(sharpness, 21);
  ModelPair dense_pair = SharpModelPair(sharpness, 21);
  EXPECT_NE(pair.cuda, nullptr);
  if (pair.cuda == nullptr) return {};
  KascadeConfig config = DenseDecodeConfig(8);
  config.top_k_ratio = ratio;
  KascadePolicy policy(config, calibration);
  const int vocab = pair.cuda->config().vocab_size;
  std::mt19937_64 rng(5);
  const std::vector<int> prompt = RandomTokens(rng, 700, vocab);
  constexpr int kSteps = 12;
  const std::vector<float> cpu_dense = Steps(*dense_pair.cpu, prompt, kSteps, nullptr);
  auto cpu_backend = policy.MakeBackend(*pair.cpu, 1);
  EXPECT_TRUE(cpu_backend.ok()) << cpu_backend.status().message();
  auto cuda_backend = policy.MakeBackend(*pair.cuda, 1);
  EXPECT_TRUE(cuda_backend.ok()) << cuda_backend.status().message();
  if (!cpu_backend.ok() || !cuda_backend.ok()) return {};
  EXPECT_TRUE(pair.cpu->SetAttentionBackend(std::move(cpu_backend).value()).ok());
  EXPECT_TRUE(pair.cuda->SetAttentionBackend(std::move(cuda_backend).value()).ok());
  const std::vector<float> cpu = Steps(*pair.cpu, prompt, kSteps, &policy);
  const std::vector<float> cuda = Steps(*pair.cuda, prompt, kSteps, &policy);
  EXPECT_EQ(cpu_dense.size(), cuda.size());
  if (cpu_dense.size() != cuda.size()) return {};
  Distances d{RelL2(cuda, cpu), RelL2(cuda, cpu_dense), pair.cuda->graph_replays()};
  const size_t row = cuda.size() / kSteps;
  std::printf(
      "[ kascade   ] sharpness %.1f ratio %.2f anchors %zu: rel L2 CUDA vs CPU kascade %.4f "
      "(per step:",
      sharpness, ratio, calibration.anchors.size(), d.to_kascade);
  for (int s = 0; s < kSteps; ++s) {
    std::printf(" %.3f", RelL2(std::span<const float>(cuda).subspan(s * row, row),
                               std::span<const float>(cpu).subspan(s * row, row)));
  }
  std::printf("), vs CPU dense %.4f\n", d.to_dense);
  return d;
}

// With k near 2 % of the context a selection's last keys carry much of its mass, and bf16
// against fp32 scores flips some of them: measured on an H100, CUDA and CPU Kascade differ by
// 0.12 rel L2 with every layer an anchor (no reuse at all) and by 0.18 with reuse, against 0.37
// and 1.08 from dense. At the paper's 10 % the cut falls where the weights are small; that is
// the checked point, the 2 % runs are printed for the record.
TEST(CudaKascade, SmallKMatchesTheCpuBackendAndReplaysAsGraphs) {
  ModelPair probe = MakeModelPair(Config(), 3);
  ASSERT_NE(probe.cuda, nullptr);
  const KascadeCalibration calibration = Calibration(probe.cuda->config());
  // Every layer its own anchor (no reuse): how far bf16 alone moves the selections.
  KascadeCalibration all_anchors = calibration;
  all_anchors.anchors = {0, 1, 2};
  all_anchors.head_map = {{0, 1}, {0, 1}, {0, 1}};
  KascadeDistances(2.0, 0.02, all_anchors);
  KascadeDistances(2.0, 0.02, calibration);
  KascadeDistances(2.0, 0.1, all_anchors);
  const Distances d = KascadeDistances(2.0, 0.1, calibration);
  EXPECT_GT(d.graph_replays, 0);
  EXPECT_LT(d.to_kascade, 0.1);
  EXPECT_LT(4 * d.to_kascade, d.to_dense);
}

// Prefill of `prompt` in chunks of `chunk` on `model`, each chunk planned by `policy` (null:
// dense), every row's logits.
std::vector<float> PlannedPrefill(Model& model, const std::vector<int>& prompt, int chunk,
                                  KascadePolicy* policy) {
  auto cache = NewCache(model, 16, 256);
  KvSequence sequence;
  std::unique_ptr<PolicyRequest> request =
      policy != nullptr ? policy->Admit(KvResidency::kLocal) : nullptr;
  std::vector<float> logits;
  ForwardResult result;
  for (int start = 0; start < static_cast<int>(prompt.size()); start += chunk) {
    const int n = std::min<int>(chunk, static_cast<int>(prompt.size()) - start);
    ForwardEntry entry{&sequence, std::span<const int>(prompt).subspan(start, n), start,
                       LogitsWanted::kAll};
    if (request != nullptr) {
      entry.attention =
          request->PlanPrefill(start, n, start + n == static_cast<int>(prompt.size()));
      EXPECT_NE(entry.attention, nullptr) << "chunk at " << start;
    }
    const Status status = model.Forward({&entry, 1}, *cache, result);
    EXPECT_TRUE(status.ok()) << status.message();
    if (!status.ok()) return {};
    const auto rows = result.EntryLogits(0);
    logits.insert(logits.end(), rows.begin(), rows.end());
  }
  return logits;
}

// Mean Jaccard overlap of two selections [tile * kv_heads + kv_head] of the same shape.
double MeanOverlap(const std::vector<std::vector<int>>& a, const std::vector<std::vector<int>>& b) {
  EXPECT_EQ(a.size(), b.size());
  if (a.empty() || a.size() != b.size()) return 0.0;
  double sum = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    std::vector<int> both;
    std::set_intersection(a[i].begin(), a[i].end(), b[i].begin(), b[i].end(),
                          std::back_inserter(both));
    const size_t either = a[i].size() + b[i].size() - both.size();
    sum += either == 0 ? 1.0 : static_cast<double>(both.size()) / either;
  }
  return sum / static_cast<double>(a.size());
}

KascadeConfig TiledConfig() {
  KascadeConfig config;  // prefill: tiled, tiles of 128, 10 % top-k
  config.top_k_min = 8;
  return config;
}

// A 700-token prompt in chunks of 256 (tiles from 128 on keep 26..77 of their earlier
// positions): the CUDA backend's tile selections on both anchors and every row's logits against
// the CPU backend's (fp32, double-precision selection), and against dense prefill.
TEST(CudaKascade, TiledPrefillMatchesTheCpuBackend) {
  ModelPair pair = SharpModelPair(2.0, 21);
  ModelPair dense_pair = SharpModelPair(2.0, 21);
  ASSERT_NE(pair.cuda, nullptr);
  KascadePolicy policy(TiledConfig(), Calibration(pair.cuda->config()));
  const int vocab = pair.cuda->config().vocab_size;
  std::mt19937_64 rng(8);
  const std::vector<int> prompt = RandomTokens(rng, 700, vocab);
  const std::vector<float> cpu_dense = PlannedPrefill(*dense_pair.cpu, prompt, 256, nullptr);
  auto cpu_backend = policy.MakeBackend(*pair.cpu, 1);
  auto cuda_backend = policy.MakeBackend(*pair.cuda, 1);
  ASSERT_TRUE(cpu_backend.ok()) << cpu_backend.status().message();
  ASSERT_TRUE(cuda_backend.ok()) << cuda_backend.status().message();
  ASSERT_TRUE(pair.cpu->SetAttentionBackend(std::move(cpu_backend).value()).ok());
  ASSERT_TRUE(pair.cuda->SetAttentionBackend(std::move(cuda_backend).value()).ok());
  const std::vector<float> cpu = PlannedPrefill(*pair.cpu, prompt, 256, &policy);
  const std::vector<float> cuda = PlannedPrefill(*pair.cuda, prompt, 256, &policy);
  ASSERT_EQ(cuda.size(), cpu.size());
  ASSERT_EQ(cuda.size(), cpu_dense.size());
  const double to_kascade = RelL2(cuda, cpu);
  const double to_dense = RelL2(cuda, cpu_dense);
  const double cpu_to_dense = RelL2(cpu, cpu_dense);
  // The last chunk's selections (tiles at 512 and 640) of both anchors.
  double overlap[2] = {0, 0};
  for (int a = 0; a < 2; ++a) {
    const int layer = a == 0 ? 0 : 2;
    const auto& want = KascadeSelectionForTest(*pair.cpu->attention_backend(), 0, layer);
    auto got = KascadeCudaPrefillSelectionsForTest(*pair.cuda->attention_backend(), layer);
    ASSERT_TRUE(got.ok()) << got.status().message();
    ASSERT_EQ(got->size(), want.size()) << "layer " << layer;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ((*got)[i].size(), want[i].size()) << "layer " << layer << " list " << i;
    }
    overlap[a] = MeanOverlap(*got, want);
  }
  std::printf(
      "[ kascade   ] tiled prefill: rel L2 CUDA vs CPU kascade %.4f, vs CPU dense %.4f (CPU "
      "kascade vs dense %.4f); selection overlap anchor 0 %.3f, anchor 2 %.3f\n",
      to_kascade, to_dense, cpu_to_dense, overlap[0], overlap[1]);
  // Measured on an H100: overlap 0.992 on layer 0 and 0.859 on anchor 2 (its keys have passed
  // two bf16 layers, and near-ties at the cut flip), rows 0.18 from CPU Kascade against 0.83
  // from dense; CPU Kascade itself is 0.83 from dense. A random choice of ~10 % of the earlier
  // positions would overlap by ~0.05.
  EXPECT_GT(overlap[0], 0.95);
  EXPECT_GT(overlap[1], 0.75);
  EXPECT_LT(to_kascade, 0.25);
  EXPECT_LT(3 * to_kascade, to_dense);
}

// One forward holding a tile-sparse chunk (its plan) and a dense chunk (none), the planned one
// first in batch order: each gives what it gives alone.
TEST(CudaKascade, TiledAndDenseChunksInOneForward) {
  ModelPair pair = SharpModelPair(2.0, 4);
  ASSERT_NE(pair.cuda, nullptr);
  KascadePolicy policy(TiledConfig(), Calibration(pair.cuda->config()));
  auto backend = policy.MakeBackend(*pair.cuda, 2);
  ASSERT_TRUE(backend.ok()) << backend.status().message();
  ASSERT_TRUE(pair.cuda->SetAttentionBackend(std::move(backend).value()).ok());
  const int vocab = pair.cuda->config().vocab_size;
  std::mt19937_64 rng(12);
  const std::vector<int> a = RandomTokens(rng, 300, vocab);
  const std::vector<int> b = RandomTokens(rng, 200, vocab);
  const std::vector<float> a_alone = PlannedPrefill(*pair.cuda, a, 300, &policy);
  const std::vector<float> a_dense = PlannedPrefill(*pair.cuda, a, 300, nullptr);
  const std::vector<float> b_alone = PlannedPrefill(*pair.cuda, b, 200, nullptr);

  auto cache = NewCache(*pair.cuda, 16, 256);
  ASSERT_NE(cache, nullptr);
  KvSequence sa, sb;
  std::unique_ptr<PolicyRequest> request = policy.Admit(KvResidency::kLocal);
  ForwardEntry entries[2] = {{&sa, a, 0, LogitsWanted::kAll}, {&sb, b, 0, LogitsWanted::kAll}};
  entries[0].attention = request->PlanPrefill(0, 300, true);
  ASSERT_NE(entries[0].attention, nullptr);
  ForwardResult result;
  const Status status = pair.cuda->Forward({entries, 2}, *cache, result);
  ASSERT_TRUE(status.ok()) << status.message();
  const auto a_mixed = result.EntryLogits(0);
  const auto b_mixed = result.EntryLogits(1);
  ASSERT_EQ(a_mixed.size(), a_alone.size());
  ASSERT_EQ(b_mixed.size(), b_alone.size());
  const double a_gap = RelL2(a_mixed, a_alone);
  const double b_gap = RelL2(b_mixed, b_alone);
  const double sparse_vs_dense = RelL2(a_alone, a_dense);
  std::printf(
      "[ kascade   ] mixed forward: tiled chunk %.5f from alone, dense chunk %.5f; tiled "
      "alone vs dense %.4f\n",
      a_gap, b_gap, sparse_vs_dense);
  // Measured on an H100: both 0 (each chunk's launch reads only its own rows), tiled against
  // dense 0.65.
  EXPECT_LT(a_gap, kRowRelL2);
  EXPECT_LT(b_gap, kRowRelL2);
  EXPECT_LT(10 * a_gap, sparse_vs_dense);
}

}  // namespace
}  // namespace rubato
