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

TEST(CudaKascade, SmallKMatchesTheCpuBackendAndReplaysAsGraphs) {
  ModelPair pair = SharpModelPair(2.0, 21);
  ModelPair dense_pair = SharpModelPair(2.0, 21);
  ASSERT_NE(pair.cuda, nullptr);
  KascadeConfig config = DenseDecodeConfig(8);
  config.top_k_ratio = 0.02;  // k = max(ceil(0.02 L), 8): 14-15 of ~700
  KascadePolicy policy(config, Calibration(pair.cuda->config()));
  const int vocab = pair.cuda->config().vocab_size;
  std::mt19937_64 rng(5);
  const std::vector<int> prompt = RandomTokens(rng, 700, vocab);
  constexpr int kSteps = 12;
  const std::vector<float> cpu_dense = Steps(*dense_pair.cpu, prompt, kSteps, nullptr);
  auto cpu_backend = policy.MakeBackend(*pair.cpu, 1);
  ASSERT_TRUE(cpu_backend.ok()) << cpu_backend.status().message();
  ASSERT_TRUE(pair.cpu->SetAttentionBackend(std::move(cpu_backend).value()).ok());
  auto cuda_backend = policy.MakeBackend(*pair.cuda, 1);
  ASSERT_TRUE(cuda_backend.ok()) << cuda_backend.status().message();
  ASSERT_TRUE(pair.cuda->SetAttentionBackend(std::move(cuda_backend).value()).ok());
  const std::vector<float> cpu = Steps(*pair.cpu, prompt, kSteps, &policy);
  const std::vector<float> cuda = Steps(*pair.cuda, prompt, kSteps, &policy);
  EXPECT_GT(pair.cuda->graph_replays(), 0);
  ASSERT_EQ(cpu_dense.size(), cuda.size());
  const double to_kascade = RelL2(cuda, cpu);
  const double to_dense = RelL2(cuda, cpu_dense);
  std::printf("[ kascade   ] rel L2 CUDA kascade vs CPU kascade %.4f, vs CPU dense %.4f\n",
              to_kascade, to_dense);
  EXPECT_LT(to_kascade, 0.1);
  EXPECT_LT(4 * to_kascade, to_dense);
}

}  // namespace
}  // namespace rubato
