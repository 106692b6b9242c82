// The model shape from a Hugging Face config.json: LlamaForCausalLM, Qwen2ForCausalLM and
// Qwen3ForCausalLM. Any other architecture is rejected by name. Values are validated (positive
// sizes, heads divisible by KV heads, hidden = heads x head_dim where the family requires it,
// known rope_scaling types) and errors name the key.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace rubato {

enum class ModelArch { kLlama, kQwen2, kQwen3 };

// "llama3" RoPE frequency scaling (Llama 3.1+). kNone: plain RoPE with `rope_theta`.
struct RopeScaling {
  enum class Type { kNone, kLlama3 };
  Type type = Type::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position_embeddings = 8192;
};

struct ModelConfig {
  ModelArch arch = ModelArch::kLlama;
  std::string architecture;  // as written in config.json, e.g. "Qwen3ForCausalLM"
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;    // num_hidden_layers
  int num_heads = 0;     // num_attention_heads
  int num_kv_heads = 0;  // num_key_value_heads (defaults to num_heads)
  int head_dim = 0;      // head_dim, or hidden_size / num_heads when absent
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;     // Qwen2: always; Llama: `attention_bias`; Qwen3: `attention_bias`
  bool o_proj_bias = false;  // Llama/Qwen3 `attention_bias` also puts a bias on o_proj
  bool qk_norm = false;      // Qwen3: RMSNorm over head_dim on q and k before RoPE
  int bos_token_id = -1;     // -1: none
  std::vector<int> eos_token_ids;
  DType torch_dtype = DType::kBF16;

  int gqa_group() const { return num_heads / num_kv_heads; }
  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
};

std::string_view ModelArchName(ModelArch arch);

// Parses config.json text. `source` names the file in error messages.
Result<ModelConfig> ParseModelConfig(std::string_view json_text, const std::string& source);

// Reads and parses `model_dir/config.json`.
Result<ModelConfig> LoadModelConfig(const std::filesystem::path& model_dir);

}  // namespace rubato
