// Deterministic random bf16 fill on the GPU: --random-weights models at real shapes (8B
// parameters would be 32 GB of host fp32, so they are generated where they live) and the decode
// benchmark's KV pools.
//
// Element i of a fill gets a value that depends only on (seed, stream, i): a counter-based
// hash (SplitMix64), never on the launch shape or on what else was filled before, so the same
// tensor is the same on every run and every GPU. Each 64-bit hash feeds two elements with 24
// random bits each. The value is
//     center + k * (bound / 2^24),  k = 2u - (2^24 - 1) for u uniform in [0, 2^24)
// i.e. uniform over 2^24 odd steps symmetric around center, inside [center - bound, center +
// bound], computed with two correctly rounded fp32 operations and then rounded to bf16 (nearest
// even). RandomFillValue is the host twin.
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
