// Deterministic random bf16 fill on the GPU: --random-weights models at real shapes and the
// decode benchmark's KV pools. Element i's value depends only on (seed, stream, i) (SplitMix64),
// never on the launch shape, uniform over 2^24 odd steps in [center - bound, center + bound],
// rounded to bf16. RandomFillValue is the host twin.
// The formula: docs/cuda_model.md "Random fill".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct RandomFillParams {
  __nv_bfloat16* out = nullptr;  // [count], bf16; any 2-byte alignment
  int64_t count = 0;
  uint64_t seed = 0;
  uint64_t stream = 0;  // e.g. the tensor's index in the weight list: independent values per tensor
  float center = 0.f;   // finite
  float bound = 0.f;    // finite, >= 0; 0 fills the constant `center` (RMSNorm scales: 1)
};

// Writes out[i] for i in [0, count); count == 0 is a no-op.
Status RandomFill(const RandomFillParams& params, cudaStream_t stream);

// The fp32 value (before the bf16 rounding) that RandomFill gives element `index`, on the host.
float RandomFillValue(const RandomFillParams& params, int64_t index);

}  // namespace rubato::cuda
