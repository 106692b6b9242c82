// The few-rows linear layer (small_rows_linear.cuh). Each warp owns kOutsPerWarp output features
// and walks their weight rows in 16-byte vectors, lane-strided (a warp reads 512 contiguous bytes
// of a row per load); the x rows, a few KB, stay in L1 and each 16 bytes of them serve every
// feature of the warp. Weights are loaded past L1 (they are read once), the partial dot products
// reduced across the warp in fp32.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/small_rows_linear.cuh"

namespace rubato::cuda {
namespace {

constexpr int kWarps = 4;                  // warps per block
constexpr int kOutsPerWarp = 4;            // output features per warp
constexpr int kVector = 8;                 // bf16 per 16-byte load
constexpr int kWarpStride = 32 * kVector;  // elements of a row one warp-wide load covers

// 16 bytes from global memory through the non-coherent path without allocating in L1: the
// weights are streamed once per call and must not evict x.
__device__ __forceinline__ uint4 LoadStreaming(const __nv_bfloat16* source) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(source));
  return v;
}

__device__ __forceinline__ void Store(float* y, float value) { *y = value; }
__device__ __forceinline__ void Store(__nv_bfloat16* y, float value) {
  *y = __float2bfloat16_rn(value);
}

template <int kRows, typename Y>
__global__ void __launch_bounds__(kWarps * 32)
    SmallRowsLinearKernel(const __nv_bfloat16* __restrict__ x,
                          const __nv_bfloat16* __restrict__ weight,
                          const __nv_bfloat16* __restrict__ bias, Y* __restrict__ y, int in,
                          int out) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int first = (static_cast<int>(blockIdx.x) * kWarps + warp) * kOutsPerWarp;
  if (first >= out) return;
  // Features past `out` (the last warp's tail) read the last row and are not stored.
  const __nv_bfloat16* rows[kOutsPerWarp];
#pragma unroll
  for (int o = 0; o < kOutsPerWarp; ++o) {
    rows[o] = weight + static_cast<size_t>(min(first + o, out - 1)) * in;
  }
  float acc[kRows][kOutsPerWarp] = {};
#pragma unroll 2
  for (int k = lane * kVector; k < in; k += kWarpStride) {
    uint4 w[kOutsPerWarp];
#pragma unroll
    for (int o = 0; o < kOutsPerWarp; ++o) w[o] = LoadStreaming(rows[o] + k);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float xs[kVector];
      LoadBf16x8(x + static_cast<size_t>(r) * in + k, xs);
#pragma unroll
      for (int o = 0; o < kOutsPerWarp; ++o) {
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&w[o]);
#pragma unroll
        for (int i = 0; i < kVector / 2; ++i) {
          const float2 f = __bfloat1622float2(pairs[i]);
          acc[r][o] = fmaf(xs[2 * i], f.x, acc[r][o]);
          acc[r][o] = fmaf(xs[2 * i + 1], f.y, acc[r][o]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int o = 0; o < kOutsPerWarp; ++o) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        acc[r][o] += __shfl_xor_sync(0xffffffffu, acc[r][o], offset);
      }
    }
  }
  if (lane != 0) return;
#pragma unroll
  for (int o = 0; o < kOutsPerWarp; ++o) {
    const int n = first + o;
    if (n >= out) break;
    const float b = bias != nullptr ? __bfloat162float(bias[n]) : 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) Store(y + static_cast<size_t>(r) * out + n, acc[r][o] + b);
  }
}

template <int kRows>
void Launch(const LinearArgs& args, cudaStream_t stream) {
  const int per_block = kWarps * kOutsPerWarp;
  const dim3 grid((args.out_features + per_block - 1) / per_block);
  if (args.y_dtype == DType::kF32) {
    SmallRowsLinearKernel<kRows, float><<<grid, kWarps * 32, 0, stream>>>(
        args.x, args.weight, args.bias, static_cast<float*>(args.y), args.in_features,
        args.out_features);
  } else {
    SmallRowsLinearKernel<kRows, __nv_bfloat16><<<grid, kWarps * 32, 0, stream>>>(
        args.x, args.weight, args.bias, static_cast<__nv_bfloat16*>(args.y), args.in_features,
        args.out_features);
  }
}

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

}  // namespace

bool SmallRowsLinearApplies(const LinearArgs& args) {
  return args.rows >= 1 && args.rows <= kSmallRowsMax && args.in_features % kVector == 0 &&
         Aligned16(args.x) && Aligned16(args.weight);
}

Status SmallRowsLinear(const LinearArgs& args, cudaStream_t stream) {
  switch (args.rows) {
    case 1:
      Launch<1>(args, stream);
      break;
    case 2:
      Launch<2>(args, stream);
      break;
    case 3:
      Launch<3>(args, stream);
      break;
    case 4:
      Launch<4>(args, stream);
      break;
    case 5:
      Launch<5>(args, stream);
      break;
    case 6:
      Launch<6>(args, stream);
      break;
    case 7:
      Launch<7>(args, stream);
      break;
    case 8:
      Launch<8>(args, stream);
      break;
    default:
      return InvalidArgumentError("small-rows linear: rows = " + std::to_string(args.rows) +
                                  " outside [1, " + std::to_string(kSmallRowsMax) + "]");
  }
  return CudaStatus(cudaGetLastError(), "small-rows linear launch");
}

}  // namespace rubato::cuda
