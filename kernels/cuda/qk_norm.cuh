// Qwen3 q/k-norm on the GPU: RMSNorm over head_dim of every head, in place, before RoPE.
// CPU twin: kernels/cpu/qk_norm.h (HeadRmsNormInPlace).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct HeadRmsNormParams {
  // Head h of token t is the [head_dim] vector at x + t * row_stride + h * head_dim (bf16), so
  // the q or k part of a fused [tokens][q | k | v] projection is normalized where it lies.
  __nv_bfloat16* x = nullptr;
  int64_t row_stride = 0;  // elements between tokens
  int tokens = 0;
  int heads = 0;
  int head_dim = 0;                       // 16, 32, 64 or 128
  const __nv_bfloat16* weight = nullptr;  // [head_dim], bf16
  float eps = 1e-6f;
};

Status HeadRmsNormInPlace(const HeadRmsNormParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
