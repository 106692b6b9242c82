// The weights of a Llama / Qwen2 / Qwen3 decoder, listed once: ListWeights() enumerates every
// tensor config.json implies (Hugging Face name, shape, random initialization, fp32 storage), and
// that one list drives loading from safetensors, shape checks, missing- and extra-tensor errors,
// memory accounting and random initialization. Optional tensors (biases, q/k norms, lm_head)
// follow config.json, not the checkpoint.
// Narrative: docs/engine_and_models.md "The weights, listed once".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/tensor.h"

namespace rubato {

// One decoder layer. Empty vectors are tensors this config does not have.
struct LayerWeights {
  std::vector<float> input_norm;           // [hidden], input_layernorm.weight
  std::vector<float> q_proj;               // [q_dim][hidden], self_attn.q_proj.weight
  std::vector<float> q_bias;               // [q_dim], self_attn.q_proj.bias (qkv_bias)
  std::vector<float> k_proj;               // [kv_dim][hidden], self_attn.k_proj.weight
  std::vector<float> k_bias;               // [kv_dim], self_attn.k_proj.bias (qkv_bias)
  std::vector<float> v_proj;               // [kv_dim][hidden], self_attn.v_proj.weight
  std::vector<float> v_bias;               // [kv_dim], self_attn.v_proj.bias (qkv_bias)
  std::vector<float> q_norm;               // [head_dim], self_attn.q_norm.weight (qk_norm)
  std::vector<float> k_norm;               // [head_dim], self_attn.k_norm.weight (qk_norm)
  std::vector<float> o_proj;               // [hidden][q_dim], self_attn.o_proj.weight
  std::vector<float> o_bias;               // [hidden], self_attn.o_proj.bias (o_proj_bias)
  std::vector<float> post_attention_norm;  // [hidden], post_attention_layernorm.weight
  std::vector<float> gate_proj;            // [intermediate][hidden], mlp.gate_proj.weight
  std::vector<float> up_proj;              // [intermediate][hidden], mlp.up_proj.weight
  std::vector<float> down_proj;            // [hidden][intermediate], mlp.down_proj.weight
};

struct ModelWeights {
  std::vector<float> embed_tokens;   // [vocab][hidden], model.embed_tokens.weight
  std::vector<LayerWeights> layers;  // [num_layers]
  std::vector<float> final_norm;     // [hidden], model.norm.weight
  std::vector<float> lm_head;        // [vocab][hidden], lm_head.weight; empty when tied

  // The output projection: lm_head, or the embedding table when embeddings are tied.
  const std::vector<float>& output_projection() const {
    return lm_head.empty() ? embed_tokens : lm_head;
  }
};

// How random initialization fills a tensor.
enum class WeightInit {
  kNormal,  // N(0, kRandomWeightStd^2): projections, embeddings, biases
  kOnes,    // RMSNorm scales
};

// transformers' default initializer_range.
inline constexpr float kRandomWeightStd = 0.02f;

struct WeightSlot {
  std::string name;  // Hugging Face tensor name, e.g. "model.layers.3.mlp.up_proj.weight"
  Shape shape;       // implied by config.json
  WeightInit init;
  std::vector<float>* storage;  // where the fp32 values go; nullptr when listed without weights
};

// Every tensor of `config`'s architecture, embeddings first, then layer by layer, then the
// final norm and lm_head. With `weights` non-null, weights->layers is resized to num_layers
// and each slot points into *weights (valid while *weights is neither moved nor resized).
std::vector<WeightSlot> ListWeights(const ModelConfig& config, ModelWeights* weights);

// Parameters and fp32 bytes of all listed tensors.
int64_t ParameterCount(const ModelConfig& config);
size_t WeightBytes(const ModelConfig& config);

// Checks `checkpoint` against the list before anything is converted: the errors LoadWeights
// describes below except ResourceExhausted. Also used by loaders that convert elsewhere (the
// CUDA model streams each tensor to the device as bf16).
Status CheckCheckpointTensors(const ModelConfig& config, const SafetensorsCheckpoint& checkpoint,
                              const std::string& source);

// Loads every listed tensor from `checkpoint`, converting to fp32. Errors name the tensor:
//   NotFound         a listed tensor is absent
//   InvalidArgument  a tensor's shape differs from what config.json implies, or the checkpoint
//                    holds tensors the architecture does not use. Those are errors rather than
//                    warnings because ignoring them would silently compute something else
//                    (typically a config.json that does not match the checkpoint). Exceptions,
//                    ignored: "*.rotary_emb.inv_freq" buffers and lm_head.weight when
//                    embeddings are tied (transformers ties it to the embedding, too).
//   ResourceExhausted  the fp32 copies do not fit in memory
// `source` names the checkpoint in messages (its directory).
Result<ModelWeights> LoadWeights(const ModelConfig& config, const SafetensorsCheckpoint& checkpoint,
                                 const std::string& source);

// Deterministic random weights from config.json alone: every tensor's values depend only on
// (seed, tensor name, element index), never on thread count or list order. Norm scales are 1;
// everything else, biases included, is N(0, 0.02^2).
Result<ModelWeights> RandomWeights(const ModelConfig& config, uint64_t seed);

// Checks that every listed tensor of `weights` has the size `config` implies (for weights built
// in code). InvalidArgument naming the first mismatch.
Status CheckWeightSizes(const ModelConfig& config, const ModelWeights& weights);

}  // namespace rubato
