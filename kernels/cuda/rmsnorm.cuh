// RMSNorm with an optional fused residual add, on the GPU; CPU twin: kernels/cpu/rmsnorm.h
// (plus kernels/cpu/add.h for the residual add).
//
// The decoder keeps its residual stream in fp32 and every sub-layer output in bf16; one call
// per norm does "residual += delta; out = weight * residual * rsqrt(mean(residual^2) + eps)".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "common/status.h"

namespace rubato::cuda {

struct RmsNormParams {
  float* residual = nullptr;              // [rows][dim], f32; updated in place when delta is set
  const __nv_bfloat16* delta = nullptr;   // [rows][dim], bf16, or nullptr (no residual add)
  const __nv_bfloat16* weight = nullptr;  // [dim], bf16
  __nv_bfloat16* out = nullptr;           // [rows][dim], bf16
  int rows = 0;
  int dim = 0;  // a multiple of 8
  float eps = 1e-6f;
};

Status RmsNorm(const RmsNormParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
