// Kascade on the CUDA model (decode; prefill dense): with k covering the context the engine
// gives the dense tokens bit for bit; with a small k, teacher-forced decode steps through the
// CUDA backend half (layer 0 dense with scores, anchors' pooled top-k with a per-row k, reuse
// layers' index gather through the head map) stay near the CPU backend half's logits and far
// from dense attention's, and replay as CUDA graphs.
#include <gtest/gtest.h>

#include <random>
#include <vector>

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
  config.prefill = "dense";  // what the CUDA backend runs
  config.top_k_min = top_k_min;
  return config;
}

std::vector<std::vector<int>> Prompts(int vocab) {
  std::mt19937_64 rng(17);
  return {RandomTokens(rng, 600, vocab), RandomTokens(rng, 333, vocab),
          RandomTokens(rng, 901, vocab)};
}

TEST(CudaKascade, KCoveringTheContextGivesTheDenseTokens) {
  ModelPair dense = MakeModelPair(Config(), /*seed=*/9);
  ModelPair kascade = MakeModelPair(Config(), /*seed=*/9);
  ASSERT_NE(dense.cuda, nullptr);
  const int vocab = dense.cuda->config().vocab_size;
  const KascadeCalibration calibration = Calibration(dense.cuda->config());
  EngineOptions options;
  options.max_batch = 3;
  const auto dense_tokens = EngineGreedyTokens(std::move(dense.cuda), options, Prompts(vocab));
  options.policy = std::make_shared<KascadePolicy>(DenseDecodeConfig(1 << 20), calibration);
  const auto kascade_tokens = EngineGreedyTokens(std::move(kascade.cuda), options, Prompts(vocab));
  EXPECT_EQ(kascade_tokens, dense_tokens);
}

TEST(CudaKascade, TiledPrefillIsRefusedByName) {
  ModelPair pair = MakeModelPair(Config(), 3);
  ASSERT_NE(pair.cuda, nullptr);
  KascadeConfig tiled;  // prefill: tiled by default
  KascadePolicy policy(tiled, Calibration(pair.cuda->config()));
  auto backend = policy.MakeBackend(*pair.cuda, 1);
  EXPECT_TRUE(gpu_test::FailsWith(backend.status(), StatusCode::kUnsupported,
                                  "not built on the CUDA backend yet; set prefill: dense"));
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

}  // namespace
}  // namespace rubato
