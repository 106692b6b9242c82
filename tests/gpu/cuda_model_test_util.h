// Helpers of the CUDA model tests (cuda_model_test.cc, cuda_model_golden_test.cc): model pairs
// with identical weights, feeding prompts in chunks, and row-wise comparisons of logits with
// bf16 tolerances.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "inference_rank/engine/engine.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/model/cuda_model.h"
#include "kernels/cpu/sampling.h"

namespace rubato::cuda_model_test {

// The bound of docs/design.md §7 for bf16 on one logits row, relaxed from 1e-2 to 2e-2 because a
// whole model compounds bf16 roundings of every activation, weight and cached key/value.
inline constexpr double kRowRelL2 = 2e-2;

inline double RelL2(std::span<const float> got, std::span<const float> ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(got[i]) - ref[i];
    diff += d * d;
    norm += double(ref[i]) * ref[i];
  }
  const double rel = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
  return std::isnan(rel) ? INFINITY : rel;
}

inline double MaxAbsDiff(std::span<const float> a, std::span<const float> b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return std::isnan(worst) ? INFINITY : worst;
}

inline double Rms(std::span<const float> row) {
  double sum = 0;
  for (float v : row) sum += double(v) * v;
  return std::sqrt(sum / std::max<size_t>(row.size(), 1));
}

// Largest minus second largest value.
inline double Top2Margin(std::span<const float> row) {
  float first = -INFINITY, second = -INFINITY;
  for (float v : row) {
    if (v > first) {
      second = first;
      first = v;
    } else if (v > second) {
      second = v;
    }
  }
  return double(first) - second;
}

// Compares [rows][vocab] logits row by row: relative L2 <= rel_l2 for every row, and the same
// argmax wherever the reference's top-2 margin exceeds clear_margin x rms(reference row) (below
// that, bf16 rounding may legitimately swap the top two). Prints the worst errors.
inline void ExpectRowsClose(const std::string& what, std::span<const float> got,
                            std::span<const float> ref, int vocab, double rel_l2 = kRowRelL2,
                            double clear_margin = 0.1) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const size_t v = static_cast<size_t>(vocab);
  const size_t rows = ref.size() / v;
  double worst = 0;
  size_t worst_row = 0, argmax_checked = 0;
  for (size_t r = 0; r < rows; ++r) {
    const auto g = got.subspan(r * v, v);
    const auto e = ref.subspan(r * v, v);
    const double rel = RelL2(g, e);
    if (rel > worst) {
      worst = rel;
      worst_row = r;
    }
    EXPECT_LE(rel, rel_l2) << what << ": row " << r << " relative L2 error";
    if (Top2Margin(e) > clear_margin * Rms(e)) {
      ++argmax_checked;
      EXPECT_EQ(ArgMax(g), ArgMax(e)) << what << ": row " << r << " argmax (reference margin "
                                      << Top2Margin(e) << ", rms " << Rms(e) << ")";
    }
  }
  std::printf("[ logits    ] %s: %zu rows, worst rel L2 %.3g (row %zu), argmax checked on %zu\n",
              what.c_str(), rows, worst, worst_row, argmax_checked);
}

// Feeds tokens at positions [start, start + tokens.size()) in chunks of `chunk`, every row's
// logits wanted; returns [tokens][vocab].
inline std::vector<float> FeedAll(Model& model, PagedKvCache& cache, KvSequence& sequence,
                                  std::span<const int> tokens, int start, int chunk,
                                  const AttentionWindow& window = AttentionWindow()) {
  std::vector<float> logits;
  ForwardResult result;
  for (size_t begin = 0; begin < tokens.size(); begin += static_cast<size_t>(chunk)) {
    const size_t n = std::min(static_cast<size_t>(chunk), tokens.size() - begin);
    ForwardEntry entry{&sequence, tokens.subspan(begin, n), start + static_cast<int>(begin),
                       LogitsWanted::kAll};
    const Status status = model.Forward({&entry, 1}, cache, result, window);
    EXPECT_TRUE(status.ok()) << status.message();
    if (!status.ok()) return {};
    const auto rows = result.EntryLogits(0);
    logits.insert(logits.end(), rows.begin(), rows.end());
  }
  return logits;
}

inline std::vector<int> RandomTokens(std::mt19937_64& rng, int count, int vocab) {
  std::vector<int> tokens(static_cast<size_t>(count));
  for (int& t : tokens) t = static_cast<int>(rng() % static_cast<uint64_t>(vocab));
  return tokens;
}

// A config.json for a small model of `arch` ("Qwen3ForCausalLM", "Qwen2ForCausalLM",
// "LlamaForCausalLM"); `extra` adds keys (with a leading comma).
inline std::string SmallConfigJson(const std::string& arch, int hidden, int heads, int kv_heads,
                                   int head_dim, int intermediate, int layers, int vocab, bool tied,
                                   const std::string& extra = "") {
  return std::string("{\"architectures\": [\"") + arch +
         "\"], \"vocab_size\": " + std::to_string(vocab) +
         ", \"hidden_size\": " + std::to_string(hidden) +
         ", \"intermediate_size\": " + std::to_string(intermediate) +
         ", \"num_hidden_layers\": " + std::to_string(layers) +
         ", \"num_attention_heads\": " + std::to_string(heads) +
         ", \"num_key_value_heads\": " + std::to_string(kv_heads) +
         ", \"head_dim\": " + std::to_string(head_dim) +
         ", \"max_position_embeddings\": 131072, \"rms_norm_eps\": 1e-6, \"rope_theta\": "
         "1000000.0, \"eos_token_id\": 2, \"tie_word_embeddings\": " +
         (tied ? "true" : "false") + extra + "}";
}

// A CPU model with random weights and a CUDA model with the same weights.
struct ModelPair {
  std::unique_ptr<CpuModel> cpu;
  std::unique_ptr<CudaModel> cuda;
};

// `adjust`, when set, changes the random weights before both models take them.
inline ModelPair MakeModelPair(const std::string& config_json, uint64_t seed,
                               bool use_cuda_graph = true,
                               const std::function<void(ModelWeights&)>& adjust = nullptr) {
  ModelPair pair;
  Result<ModelConfig> config = ParseModelConfig(config_json, "test config.json");
  EXPECT_TRUE(config.ok()) << config.status().message();
  if (!config.ok()) return pair;
  Result<ModelWeights> weights = RandomWeights(*config, seed);
  EXPECT_TRUE(weights.ok()) << weights.status().message();
  if (!weights.ok()) return pair;
  if (adjust) adjust(*weights);
  CudaModelOptions options;
  options.use_cuda_graph = use_cuda_graph;
  auto cuda = CudaModel::Create(*config, *weights, options);
  EXPECT_TRUE(cuda.ok()) << cuda.status().message();
  if (cuda.ok()) pair.cuda = std::move(cuda).value();
  auto cpu = CpuModel::Create(*config, std::move(weights).value(), ModelLoadOptions{});
  EXPECT_TRUE(cpu.ok()) << cpu.status().message();
  if (cpu.ok()) pair.cpu = std::move(cpu).value();
  return pair;
}

inline std::unique_ptr<PagedKvCache> NewCache(Model& model, int block_tokens, int num_blocks) {
  auto cache = model.CreateKvCache(block_tokens, num_blocks);
  EXPECT_TRUE(cache.ok()) << cache.status().message();
  return cache.ok() ? std::move(cache).value() : nullptr;
}

// Greedy tokens per prompt from an engine on `model` under `options`, every prompt submitted at
// once with 40 new tokens (at most 10000 engine steps). Optionally the smallest retained-KV ratio
// any event reported.
inline std::vector<std::vector<int>> EngineGreedyTokens(
    std::unique_ptr<Model> model, const EngineOptions& options,
    const std::vector<std::vector<int>>& prompts, double* min_retained = nullptr,
    bool ignore_eos = false) {
  auto engine = Engine::Create(std::move(model), options);
  EXPECT_TRUE(engine.ok()) << engine.status().message();
  if (!engine.ok()) return {};
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest request;
    request.prompt_ids = prompts[i];
    request.max_new_tokens = 40;
    request.ignore_eos = ignore_eos;
    auto id = (*engine)->Submit(request);
    EXPECT_TRUE(id.ok()) << id.status().message();
    if (id.ok()) index[*id] = i;
  }
  std::vector<std::vector<int>> tokens(prompts.size());
  if (min_retained != nullptr) *min_retained = 1.0;
  for (int step = 0; (*engine)->HasWork() && step < 10000; ++step) {
    auto events = (*engine)->Step();
    EXPECT_TRUE(events.ok()) << events.status().message();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      tokens[index[event.request_id]].push_back(event.token);
      if (min_retained != nullptr) {
        *min_retained = std::min(*min_retained, event.retained_kv_ratio);
      }
    }
  }
  return tokens;
}

}  // namespace rubato::cuda_model_test
