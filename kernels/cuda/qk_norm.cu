// Qwen3 q/k-norm on the GPU (qk_norm.cuh): RMSNorm of every [head_dim] head, in place, where
// the heads lie in the fused qkv projection.
//
// A head is head_dim / 8 16-byte vectors; a group of that many adjacent lanes (2..16, so it
// never straddles a warp) normalizes one head, one vector per lane, and reduces the sum of
// squares with xor shuffles inside the group. No shared memory, no block barrier.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/qk_norm.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;

// ---- kernel ----------------------------------------------------------------------------------

// One lane per 8 elements of a head; head index (over tokens * heads, token-major) =
// global thread / kLanes. Lanes past the last head still take part in the shuffles (with zeros)
// and only skip the store, so every __shfl_xor_sync runs on a full warp.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) HeadRmsNormKernel(HeadRmsNormParams p) {
  constexpr int kLanes = kHeadDim / 8;
  static_assert(kLanes >= 1 && kLanes <= 32 && 32 % kLanes == 0, "a head must fit in a warp");
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t head_index = thread / kLanes;
  const int lane = static_cast<int>(thread % kLanes);
  const bool active = head_index < static_cast<int64_t>(p.tokens) * p.heads;

  __nv_bfloat16* vector = nullptr;
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = 0.0f;
  if (active) {
    const int64_t token = head_index / p.heads;
    const int head = static_cast<int>(head_index % p.heads);
    vector = p.x + token * p.row_stride + static_cast<int64_t>(head) * kHeadDim + 8 * lane;
    LoadBf16x8(vector, x);
  }
  float sum_squares = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum_squares += x[i] * x[i];
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, offset);
  }
  if (!active) return;

  const float inv_rms = 1.0f / sqrtf(sum_squares / static_cast<float>(kHeadDim) + p.eps);
  float weight[8];
  LoadBf16x8(p.weight + 8 * lane, weight);
  float out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = weight[i] * (x[i] * inv_rms);
  StoreBf16x8(vector, out);
}

Status ValidateHeadRmsNormParams(const HeadRmsNormParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status HeadRmsNormInPlace(const HeadRmsNormParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidateHeadRmsNormParams(params));
  if (params.tokens == 0 || params.heads == 0) return Status::Ok();
  RUBATO_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, {
    const int64_t threads = static_cast<int64_t>(params.tokens) * params.heads * (kHeadDim / 8);
    const int64_t blocks = (threads + kThreads - 1) / kThreads;
    if (blocks > 0x7fffffff) {
      return InvalidArgumentError("CUDA HeadRmsNormInPlace: " + std::to_string(params.tokens) +
                                  " tokens x " + std::to_string(params.heads) +
                                  " heads is more than one launch can cover");
    }
    HeadRmsNormKernel<kHeadDim><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
    return LaunchStatus("HeadRmsNormKernel");
  });
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status ValidateHeadRmsNormParams(const HeadRmsNormParams& p) {
  const std::string op = "CUDA HeadRmsNormInPlace: ";
  if (p.tokens < 0) return InvalidArgumentError(op + "tokens is " + std::to_string(p.tokens));
  if (p.heads < 0) return InvalidArgumentError(op + "heads is " + std::to_string(p.heads));
  if (p.head_dim <= 0) {
    return InvalidArgumentError(op + "head_dim is " + std::to_string(p.head_dim));
  }
  // Unsupported positive head_dim values are reported by the dispatch in the launcher.
  if (p.row_stride % 8 != 0 || p.row_stride < static_cast<int64_t>(p.heads) * p.head_dim) {
    return InvalidArgumentError(op + "row_stride is " + std::to_string(p.row_stride) +
                                "; it must be a multiple of 8 and at least heads * head_dim = " +
                                std::to_string(static_cast<int64_t>(p.heads) * p.head_dim));
  }
  if (!(p.eps >= 0.0f)) return InvalidArgumentError(op + "eps must be >= 0");
  if (p.tokens == 0 || p.heads == 0) return Status::Ok();  // nothing is read or written
  if (p.x == nullptr) return InvalidArgumentError(op + "x is null");
  if (p.weight == nullptr) return InvalidArgumentError(op + "weight is null");
  if (!Aligned16(p.x)) return InvalidArgumentError(op + "x is not 16-byte aligned");
  if (!Aligned16(p.weight)) return InvalidArgumentError(op + "weight is not 16-byte aligned");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
