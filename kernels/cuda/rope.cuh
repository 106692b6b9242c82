// Rotary position embedding on the GPU, Hugging Face rotate_half layout, default or llama3
// frequencies (both come in through inv_freq). CPU twin: kernels/cpu/rope.h (RopeCosSin +
// ApplyRope).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct RopeParams {
  // Head h of token t is at x + t * row_stride + h * head_dim (bf16), rotated in place. In a
  // fused [tokens][q | k | v] projection the q and k heads are adjacent, so one call with
  // heads = num_heads + num_kv_heads rotates both.
  __nv_bfloat16* x = nullptr;
  int64_t row_stride = 0;  // elements between tokens
  int tokens = 0;
  int heads = 0;
  int head_dim = 0;                    // even
  const int32_t* positions = nullptr;  // [tokens], device
  const float* inv_freq = nullptr;     // [head_dim / 2], f32, device (RopeInverseFrequencies)
};

// angle = float(position) * inv_freq[i] in fp32, then the rotation of rope.h with cos/sin of
// that angle computed in fp32.
Status ApplyRope(const RopeParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
