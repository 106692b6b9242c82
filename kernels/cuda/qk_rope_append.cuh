// Fused q/k-norm, RoPE and KV append on the GPU: the three steps between a layer's qkv
// projection and its attention in one launch (a decode step pays a launch and a pass over the
// heads per op otherwise). Bit for bit the results of HeadRmsNormInPlace (q and k), ApplyRope
// (q and k heads) and AppendToPagedKv in that order: the same fp32 arithmetic, with the normed
// heads rounded to bf16 before the rotation as the separate ops store them.
// CPU twin: kernels/cpu/qk_rope_append.h. Narrative: docs/cuda_model.md "Fused q/k-norm, RoPE
// and KV append".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct QkRopeAppendParams {
  // [tokens][q heads | k heads | v heads] (bf16, row_stride elements apart): q and k are normed
  // (when the weights are set) and rotated in place; k (after both) and v are copied to the pools.
  __nv_bfloat16* qkv = nullptr;
  int64_t row_stride = 0;
  int tokens = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // 16, 32, 64 or 128
  // [head_dim] each, or both null (a model without q/k-norm).
  const __nv_bfloat16* q_norm_weight = nullptr;
  const __nv_bfloat16* k_norm_weight = nullptr;
  float eps = 0;
  const int32_t* positions = nullptr;  // [tokens], device
  const float* inv_freq = nullptr;     // [head_dim / 2], f32, device
  // [tokens], device: physical_block * block_tokens + row; a negative slot skips the append.
  const int32_t* slots = nullptr;
  int block_tokens = 0;
  __nv_bfloat16* key_pool = nullptr;    // [blocks][num_kv_heads][block_tokens][head_dim]
  __nv_bfloat16* value_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
};

Status QkNormRopeAppend(const QkRopeAppendParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
