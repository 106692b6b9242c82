// Device helpers for 16-byte bf16 vectors (8 elements): the access width every memory-bound
// kernel uses (docs/design.md §10 "Hopper memory access").
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace rubato::cuda {

// Loads 8 bf16 (16 bytes, 16-byte aligned) and widens them to fp32.
__device__ __forceinline__ void LoadBf16x8(const __nv_bfloat16* source, float (&out)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(source);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Rounds 8 fp32 to bf16 (nearest even) and stores them (16 bytes, 16-byte aligned).
__device__ __forceinline__ void StoreBf16x8(__nv_bfloat16* dest, const float (&in)[8]) {
  uint4 raw;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<uint4*>(dest) = raw;
}

}  // namespace rubato::cuda
