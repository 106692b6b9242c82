// Tiny config.json models for tests (see tiny_test_models.h).
#include "inference_rank/model/tiny_test_models.h"

#include <fstream>

namespace rubato {

std::string TinyModelName(TinyModelKind kind) {
  switch (kind) {
    case TinyModelKind::kQwen3:
      return "qwen3";
    case TinyModelKind::kQwen2:
      return "qwen2";
    case TinyModelKind::kLlama:
      return "llama";
  }
  return "unknown";
}

std::string TinyConfigJson(TinyModelKind kind) {
  const std::string shape = R"(
  "vocab_size": 97,
  "hidden_size": 64,
  "intermediate_size": 96,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 16,
  "hidden_act": "silu",
  "max_position_embeddings": 512,
  "rms_norm_eps": 1e-06,
  "eos_token_id": 2,
  "torch_dtype": "float32",)";
  switch (kind) {
    case TinyModelKind::kQwen3:
      return R"({
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",)" +
             shape + R"(
  "rope_theta": 1000000.0,
  "attention_bias": false,
  "tie_word_embeddings": true
})";
    case TinyModelKind::kQwen2:
      return R"({
  "architectures": ["Qwen2ForCausalLM"],
  "model_type": "qwen2",)" +
             shape + R"(
  "rope_theta": 10000.0,
  "tie_word_embeddings": false
})";
    case TinyModelKind::kLlama:
      return R"({
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",)" +
             shape + R"(
  "rope_theta": 500000.0,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
  "attention_bias": true,
  "tie_word_embeddings": false
})";
  }
  return "";
}

Result<std::unique_ptr<CpuModel>> LoadTinyModel(TinyModelKind kind,
                                                const std::filesystem::path& dir, uint64_t seed,
                                                int num_threads) {
  std::ofstream(dir / "config.json") << TinyConfigJson(kind);
  ModelLoadOptions options;
  options.random_weights = true;
  options.seed = seed;
  options.num_threads = num_threads;
  return CpuModel::Load(dir, options);
}

}  // namespace rubato
