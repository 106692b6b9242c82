// SwiGLU of the Llama / Qwen MLP on the GPU: out = silu(gate) * up. CPU twin:
// kernels/cpu/swiglu.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "common/status.h"

namespace rubato::cuda {

struct SwiGluParams {
  // [tokens][2 * intermediate], bf16: the fused gate_up projection, gate in columns
  // [0, intermediate) and up in [intermediate, 2 * intermediate) of each row.
  const __nv_bfloat16* gate_up = nullptr;
  __nv_bfloat16* out = nullptr;  // [tokens][intermediate], bf16
  int tokens = 0;
  int intermediate = 0;  // a multiple of 8
};

Status SwiGlu(const SwiGluParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
