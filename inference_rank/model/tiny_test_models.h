// Tiny models for unit tests: a config.json written into a temporary directory and random
// weights from it (hidden 64, 4 heads, 2 KV heads, head_dim 16, 2 layers, vocab 97), one per
// family feature the forward pass has to get right.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "common/status.h"
#include "inference_rank/model/cpu_model.h"

namespace rubato {

enum class TinyModelKind {
  kQwen3,  // Qwen3ForCausalLM: q/k-norm, tied embeddings
  kQwen2,  // Qwen2ForCausalLM: q/k/v biases, untied lm_head
  kLlama,  // LlamaForCausalLM: llama3 RoPE scaling (original context 64), attention_bias
           // (q/k/v and o_proj biases), untied lm_head
};

std::string TinyModelName(TinyModelKind kind);

// The config.json text of `kind`. intermediate_size is 96, max_position_embeddings 512,
// eos_token_id 2.
std::string TinyConfigJson(TinyModelKind kind);

// Writes TinyConfigJson(kind) to dir/config.json and loads it with random weights.
Result<std::unique_ptr<CpuModel>> LoadTinyModel(TinyModelKind kind,
                                                const std::filesystem::path& dir, uint64_t seed = 1,
                                                int num_threads = 2);

}  // namespace rubato
