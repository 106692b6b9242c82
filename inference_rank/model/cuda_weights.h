// The CUDA model's weights: bf16 on the device, with the projections that read the same input
// fused into one matrix each, so that a layer runs three GEMMs over its input rows instead of
// five:
//   qkv      = [q_proj | k_proj | v_proj] rows  -> one [q_dim + 2 kv_dim][hidden] weight
//   gate_up  = [gate_proj | up_proj] rows       -> one [2 intermediate][hidden] weight
// (and Qwen2's q/k/v biases -> one [q_dim + 2 kv_dim] bias). Tied embeddings keep one table,
// read by the embedding lookup and by the lm_head.
//
// The tensors are those of model_weights.h's ListWeights (one list for names, shapes, checks and
// accounting); each listed tensor has one destination in these buffers. Three sources:
//   * host fp32 ModelWeights (tests: the CPU model's own weights), rounded to bf16;
//   * a safetensors checkpoint, streamed tensor by tensor (bf16 copied as is, f16 and f32
//     converted to bf16 on the host, one tensor at a time: never the whole model in fp32);
//   * random weights generated on the device (kernels/cuda/random_fill.cuh): uniform in
//     [-sqrt(3) 0.02, sqrt(3) 0.02] (std 0.02, transformers' initializer_range) for projections,
//     embeddings and biases, 1 for RMSNorm scales; values depend on (seed, tensor index in the
//     list, element) only.
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
