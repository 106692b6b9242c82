// Deterministic random bf16 fill (random_fill.cuh): kernel, launcher, validation.
#include <cmath>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/random_fill.cuh"

namespace rubato::cuda {
namespace {

constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ull;
constexpr int kThreads = 256;
constexpr int kPerThread = 8;  // one 16-byte store
// Enough blocks to fill every SM of an H200 many times over; larger fills loop (grid stride).
constexpr int64_t kMaxBlocks = 8192;

// The SplitMix64 finalizer: a bijective 64-bit mixer.
__host__ __device__ inline uint64_t Mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Per-fill key: distinct (seed, stream) pairs give unrelated sequences.
__host__ __device__ inline uint64_t FillKey(uint64_t seed, uint64_t stream) {
  return Mix64(seed ^ Mix64(stream + kGoldenGamma));
}

// 24 random bits of element `index`: pair index / 2 shares one hash (SplitMix64's sequence
// key + (j + 1) * gamma), the even element takes bits [40, 64), the odd one bits [16, 40).
__host__ __device__ inline uint32_t RandomBits24(uint64_t key, uint64_t index) {
  const uint64_t h = Mix64(key + (index / 2 + 1) * kGoldenGamma);
  return (index & 1) ? static_cast<uint32_t>((h >> 16) & 0xffffffu)
                     : static_cast<uint32_t>(h >> 40);
}

// center + k * step with k = 2u - (2^24 - 1), exactly representable; the product and the sum
// are rounded separately on both sides (no FMA contraction on the device), so the host twin
// gives the same fp32 value.
__host__ __device__ inline float FillValue(uint64_t key, uint64_t index, float center, float step) {
  const int32_t k = static_cast<int32_t>(2 * RandomBits24(key, index)) - 16777215;
#ifdef __CUDA_ARCH__
  return __fadd_rn(__fmul_rn(static_cast<float>(k), step), center);
#else
  const float product = static_cast<float>(k) * step;
  return product + center;
#endif
}

// ---- kernel -----------------------------------------------------------------------------------

// Each thread writes runs of 8 elements; kAligned: `out` is 16-byte aligned, so full runs are one
// vector store. The tail run (count % 8) and unaligned buffers store element by element.
template <bool kAligned>
__global__ void RandomFillKernel(__nv_bfloat16* __restrict__ out, int64_t count, uint64_t key,
                                 float center, float step) {
  const int64_t runs = (count + kPerThread - 1) / kPerThread;
  for (int64_t run = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; run < runs;
       run += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t first = run * kPerThread;
    if (kAligned && first + kPerThread <= count) {
      float values[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        values[i] = FillValue(key, static_cast<uint64_t>(first + i), center, step);
      }
      StoreBf16x8(out + first, values);
    } else {
      const int64_t end = first + kPerThread < count ? first + kPerThread : count;
      for (int64_t i = first; i < end; ++i) {
        out[i] = __float2bfloat16_rn(FillValue(key, static_cast<uint64_t>(i), center, step));
      }
    }
  }
}

Status Validate(const RandomFillParams& p);

float Step(const RandomFillParams& p) { return std::ldexp(p.bound, -24); }

}  // namespace

// ---- launcher ---------------------------------------------------------------------------------

Status RandomFill(const RandomFillParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.count == 0) return Status::Ok();
  const int64_t runs = (params.count + kPerThread - 1) / kPerThread;
  const int64_t wanted = (runs + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < kMaxBlocks ? wanted : kMaxBlocks);
  const uint64_t key = FillKey(params.seed, params.stream);
  const bool aligned = reinterpret_cast<uintptr_t>(params.out) % 16 == 0;
  if (aligned) {
    RandomFillKernel<true><<<blocks, kThreads, 0, stream>>>(params.out, params.count, key,
                                                            params.center, Step(params));
  } else {
    RandomFillKernel<false><<<blocks, kThreads, 0, stream>>>(params.out, params.count, key,
                                                             params.center, Step(params));
  }
  return LaunchStatus("random_fill");
}

float RandomFillValue(const RandomFillParams& params, int64_t index) {
  return FillValue(FillKey(params.seed, params.stream), static_cast<uint64_t>(index), params.center,
                   Step(params));
}

namespace {

// ---- validation ---------------------------------------------------------------------------------

Status Validate(const RandomFillParams& p) {
  if (p.count < 0) {
    return InvalidArgumentError("RandomFill: count " + std::to_string(p.count) + " is negative");
  }
  if (p.count > 0 && p.out == nullptr) return InvalidArgumentError("RandomFill: out is null");
  if (!std::isfinite(p.center)) return InvalidArgumentError("RandomFill: center is not finite");
  if (!std::isfinite(p.bound) || p.bound < 0.f) {
    return InvalidArgumentError("RandomFill: bound " + std::to_string(p.bound) +
                                " must be finite and >= 0");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
