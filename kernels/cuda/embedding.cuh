// Token embedding lookup on the GPU; CPU twin: kernels/cpu/embedding.h (EmbeddingLookup).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct EmbeddingParams {
  const __nv_bfloat16* table = nullptr;  // [vocab_size][hidden], bf16
  const int32_t* token_ids = nullptr;    // [tokens], device; the caller validates the ids
  int tokens = 0;
  int hidden = 0;  // a multiple of 8
  int vocab_size = 0;
  float* out = nullptr;  // [tokens][hidden], f32: the residual stream
};

// out[t][:] = table[token_ids[t]][:] widened to fp32. An id outside [0, vocab_size) (which the
// engine rejects before it gets here) writes a row of NaN rather than reading out of bounds.
Status EmbeddingLookup(const EmbeddingParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
