// The CUDA model's weights: bf16 on the device, the projections that read the same input fused
// (qkv = [q_proj | k_proj | v_proj], gate_up = [gate_proj | up_proj], Qwen2's q/k/v biases), so a
// layer runs three GEMMs instead of five; tied embeddings keep one table. The tensors are
// model_weights.h's ListWeights; sources: host fp32 ModelWeights, a safetensors checkpoint
// streamed tensor by tensor, or random weights generated on the device.
// Narrative: docs/cuda_model.md "Weights".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "inference_rank/model/model_weights.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

// One decoder layer, bf16. Empty buffers are tensors this config does not have.
struct CudaLayerWeights {
  cuda::DeviceBuffer<__nv_bfloat16> input_norm;           // [hidden]
  cuda::DeviceBuffer<__nv_bfloat16> qkv;                  // [q_dim + 2 kv_dim][hidden]
  cuda::DeviceBuffer<__nv_bfloat16> qkv_bias;             // [q_dim + 2 kv_dim] (qkv_bias)
  cuda::DeviceBuffer<__nv_bfloat16> q_norm;               // [head_dim] (qk_norm)
  cuda::DeviceBuffer<__nv_bfloat16> k_norm;               // [head_dim] (qk_norm)
  cuda::DeviceBuffer<__nv_bfloat16> o_proj;               // [hidden][q_dim]
  cuda::DeviceBuffer<__nv_bfloat16> o_bias;               // [hidden] (o_proj_bias)
  cuda::DeviceBuffer<__nv_bfloat16> post_attention_norm;  // [hidden]
  cuda::DeviceBuffer<__nv_bfloat16> gate_up;              // [2 intermediate][hidden]
  cuda::DeviceBuffer<__nv_bfloat16> down;                 // [hidden][intermediate]
};

struct CudaWeights {
  cuda::DeviceBuffer<__nv_bfloat16> embed_tokens;  // [vocab][hidden]
  std::vector<CudaLayerWeights> layers;            // [num_layers]
  cuda::DeviceBuffer<__nv_bfloat16> final_norm;    // [hidden]
  cuda::DeviceBuffer<__nv_bfloat16> lm_head;       // [vocab][hidden]; empty when tied

  // [vocab][hidden]: lm_head, or the embedding table when embeddings are tied.
  const __nv_bfloat16* output_projection() const {
    return lm_head.size() > 0 ? lm_head.data() : embed_tokens.data();
  }
};

// Bytes of the bf16 weights of `config` (every listed tensor once; a tied lm_head is the
// embedding).
size_t CudaWeightBytes(const ModelConfig& config);

// The three sources (see the file comment). All allocate on the current device and return once
// the weights are there; ResourceExhausted names the bytes asked for and what for.
Result<CudaWeights> UploadCudaWeights(const ModelConfig& config, const ModelWeights& host);
Result<CudaWeights> LoadCudaWeights(const ModelConfig& config,
                                    const SafetensorsCheckpoint& checkpoint,
                                    const std::string& source);
Result<CudaWeights> RandomCudaWeights(const ModelConfig& config, uint64_t seed);

}  // namespace rubato
