// RMSNorm with an optional fused residual add on the GPU (rmsnorm.cuh).
//
// One block per row. Each thread keeps its part of the fp32 row in registers (kVectorsPerThread
// vectors of 8), so the row is read from memory once: residual (+ delta) -> sum of squares ->
// block reduction -> scaled bf16 output, with the updated residual written on the way. The row
// length picks kVectorsPerThread so that a block has at most kMaxThreads threads; rows up to
// kMaxThreads * 8 * 8 = 32768 elements fit (real hidden sizes are 1024..16384).
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/rmsnorm.cuh"

namespace rubato::cuda {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kMaxVectorsPerThread = 8;
constexpr int kMaxDim = kMaxThreads * kMaxVectorsPerThread * 8;

// ---- kernels ---------------------------------------------------------------------------------

// Sum of `value` over the block, returned to every thread. blockDim.x must be a multiple of 32.
// Called once per kernel, so its shared array needs no second barrier before reuse.
__device__ __forceinline__ float BlockSum(float value) {
  __shared__ float warp_sums[32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
  __syncthreads();
  // Every thread adds the (at most 16) warp sums in the same order: the same total everywhere
  // without a second barrier.
  float total = 0.0f;
  const int warps = blockDim.x / 32;
  for (int w = 0; w < warps; ++w) total += warp_sums[w];
  return total;
}

// Row blockIdx.x. Thread t owns vectors t, t + blockDim.x, ... (kVectorsPerThread of them, the
// last ones possibly past the row end), so every load and store is coalesced across the block.
template <int kVectorsPerThread, bool kAddDelta>
__global__ void __launch_bounds__(kMaxThreads) RmsNormKernel(RmsNormParams p) {
  WaitForPriorGrids();
  const int vectors = p.dim / 8;
  const int64_t row_offset = static_cast<int64_t>(blockIdx.x) * p.dim;
  float* residual = p.residual + row_offset;

  float x[kVectorsPerThread][8];
  float sum_squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kVectorsPerThread; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
#pragma unroll
    for (int i = 0; i < 8; ++i) x[j][i] = 0.0f;
    if (v >= vectors) continue;
    float4* residual4 = reinterpret_cast<float4*>(residual + 8 * v);
    const float4 lo = residual4[0];
    const float4 hi = residual4[1];
    x[j][0] = lo.x, x[j][1] = lo.y, x[j][2] = lo.z, x[j][3] = lo.w;
    x[j][4] = hi.x, x[j][5] = hi.y, x[j][6] = hi.z, x[j][7] = hi.w;
    if constexpr (kAddDelta) {
      float delta[8];
      LoadBf16x8(p.delta + row_offset + 8 * v, delta);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[j][i] += delta[i];
      residual4[0] = make_float4(x[j][0], x[j][1], x[j][2], x[j][3]);
      residual4[1] = make_float4(x[j][4], x[j][5], x[j][6], x[j][7]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sum_squares += x[j][i] * x[j][i];
  }

  const float total = BlockSum(sum_squares);
  // 1 / sqrt rather than rsqrtf: correctly rounded, like the CPU twin and torch.rsqrt's result
  // to within an ulp; it runs once per row.
  const float inv_rms = 1.0f / sqrtf(total / static_cast<float>(p.dim) + p.eps);

#pragma unroll
  for (int j = 0; j < kVectorsPerThread; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v >= vectors) continue;
    float weight[8];
    LoadBf16x8(p.weight + 8 * v, weight);
    float out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = weight[i] * (x[j][i] * inv_rms);
    StoreBf16x8(p.out + row_offset + 8 * v, out);
  }
}

template <int kVectorsPerThread>
void LaunchRmsNorm(const RmsNormParams& params, int threads, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(params.rows));
  if (params.delta != nullptr) {
    LaunchPdl(RmsNormKernel<kVectorsPerThread, true>, grid, dim3(threads), 0, stream, params);
  } else {
    LaunchPdl(RmsNormKernel<kVectorsPerThread, false>, grid, dim3(threads), 0, stream, params);
  }
}

Status ValidateRmsNormParams(const RmsNormParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status RmsNorm(const RmsNormParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidateRmsNormParams(params));
  if (params.rows == 0) return Status::Ok();
  // The fewest vectors per thread that keep the block within kMaxThreads; the block is rounded
  // up to whole warps (BlockSum's shuffles need full warps; extra threads hold no vectors).
  const int vectors = params.dim / 8;
  int per_thread = 1;
  while (per_thread < kMaxVectorsPerThread && vectors > per_thread * kMaxThreads) per_thread *= 2;
  const int threads = ((vectors + per_thread - 1) / per_thread + 31) / 32 * 32;
  switch (per_thread) {
    case 1:
      LaunchRmsNorm<1>(params, threads, stream);
      break;
    case 2:
      LaunchRmsNorm<2>(params, threads, stream);
      break;
    case 4:
      LaunchRmsNorm<4>(params, threads, stream);
      break;
    default:
      LaunchRmsNorm<8>(params, threads, stream);
      break;
  }
  return LaunchStatus("RmsNormKernel");
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status ValidateRmsNormParams(const RmsNormParams& p) {
  const std::string op = "CUDA RmsNorm: ";
  if (p.rows < 0) return InvalidArgumentError(op + "rows is " + std::to_string(p.rows));
  if (p.dim <= 0 || p.dim % 8 != 0) {
    return InvalidArgumentError(op + "dim is " + std::to_string(p.dim) +
                                "; it must be a positive multiple of 8 (16-byte rows)");
  }
  if (p.dim > kMaxDim) {
    return UnsupportedError(op + "dim " + std::to_string(p.dim) + " is larger than " +
                            std::to_string(kMaxDim) + ", the longest row kept in registers");
  }
  if (!(p.eps >= 0.0f)) return InvalidArgumentError(op + "eps must be >= 0");
  if (p.rows == 0) return Status::Ok();  // nothing is read or written
  if (p.residual == nullptr) return InvalidArgumentError(op + "residual is null");
  if (p.weight == nullptr) return InvalidArgumentError(op + "weight is null");
  if (p.out == nullptr) return InvalidArgumentError(op + "out is null");
  if (!Aligned16(p.residual)) return InvalidArgumentError(op + "residual is not 16-byte aligned");
  if (p.delta != nullptr && !Aligned16(p.delta)) {
    return InvalidArgumentError(op + "delta is not 16-byte aligned");
  }
  if (!Aligned16(p.weight)) return InvalidArgumentError(op + "weight is not 16-byte aligned");
  if (!Aligned16(p.out)) return InvalidArgumentError(op + "out is not 16-byte aligned");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
