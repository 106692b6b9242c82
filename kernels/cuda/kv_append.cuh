// Paged KV append on the GPU: writes the new tokens' K and V of one layer into their slots.
// CPU twin: kernels/cpu/kv_append.h (AppendToPagedKv).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct KvAppendParams {
  // KV head h of token t is at keys / values + t * row_stride + h * head_dim (bf16): the k and v
  // parts of a fused [tokens][q | k | v] projection, keys after RoPE.
  const __nv_bfloat16* keys = nullptr;
  const __nv_bfloat16* values = nullptr;
  int64_t row_stride = 0;
  // [tokens], device: slot of each token, physical_block * block_tokens + row, computed once
  // per forward from the block tables (the same in every layer). A negative slot skips the token.
  const int32_t* slots = nullptr;
  int tokens = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // a multiple of 8
  int block_tokens = 0;
  __nv_bfloat16* key_pool = nullptr;    // [blocks][num_kv_heads][block_tokens][head_dim], bf16
  __nv_bfloat16* value_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim], bf16
};

Status AppendToPagedKv(const KvAppendParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
