// Fused q/k-norm, RoPE and KV append (qk_rope_append.cuh).
//
// A group of head_dim / 8 adjacent lanes owns one head of one token, 8 elements per lane (as
// HeadRmsNormKernel). A block is one token and 128 / (head_dim / 8) of its heads; its first
// head_dim / 2 threads compute the token's cos / sin into shared memory once. The rotation's
// partner elements (i, i + head_dim / 2) sit in lanes l and l ^ (lanes / 2) of the group, so they
// swap with one shuffle. Every lane runs every shuffle (v heads and lanes past the last head
// with zeros), so each __shfl_xor_sync sees a full warp.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/qk_rope_append.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 128;

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) QkRopeAppendKernel(QkRopeAppendParams p) {
  constexpr int kLanes = kHeadDim / 8;
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kHeadsPerBlock = kThreads / kLanes;
  static_assert(kLanes >= 2 && kLanes <= 32 && 32 % kLanes == 0, "a head must fit in a warp");
  __shared__ float cos_table[kHalf], sin_table[kHalf];
  WaitForPriorGrids();

  const int64_t token = blockIdx.x;
  if (threadIdx.x < kHalf) {  // as RopeKernel: one fp32 product, then precise sincosf
    const float angle = static_cast<float>(p.positions[token]) * p.inv_freq[threadIdx.x];
    sincosf(angle, &sin_table[threadIdx.x], &cos_table[threadIdx.x]);
  }
  __syncthreads();

  const int lane = threadIdx.x % kLanes;
  const int head = blockIdx.y * kHeadsPerBlock + threadIdx.x / kLanes;
  const int q_and_k = p.num_heads + p.num_kv_heads;
  const bool active = head < q_and_k + p.num_kv_heads;
  const bool rotated = head < q_and_k;  // q or k; v heads are only copied
  __nv_bfloat16* vector =
      p.qkv + token * p.row_stride + static_cast<int64_t>(head) * kHeadDim + 8 * lane;
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = 0.0f;
  if (active) LoadBf16x8(vector, x);

  // q/k-norm (HeadRmsNormKernel's arithmetic and reduction order), rounded to bf16 as it stores.
  float sum_squares = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum_squares += x[i] * x[i];
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, offset);
  }
  const __nv_bfloat16* weight = head < p.num_heads ? p.q_norm_weight : p.k_norm_weight;
  if (rotated && weight != nullptr) {
    const float inv_rms = 1.0f / sqrtf(sum_squares / static_cast<float>(kHeadDim) + p.eps);
    float w[8];
    LoadBf16x8(weight + 8 * lane, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = __bfloat162float(__float2bfloat16_rn(w[i] * (x[i] * inv_rms)));
    }
  }

  // RoPE (RopeKernel's arithmetic): lanes below kLanes / 2 hold x1 = elements i, the others
  // x2 = elements i + half, for the frequencies 8 * (lane % (kLanes / 2)) + j.
  const bool first_half = lane < kLanes / 2;
  const int frequency = 8 * (lane % (kLanes / 2));
  float out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float partner = __shfl_xor_sync(0xffffffffu, x[i], kLanes / 2);
    const float c = cos_table[frequency + i], s = sin_table[frequency + i];
    out[i] = first_half ? x[i] * c - partner * s : x[i] * c + partner * s;
  }
  if (!active) return;
  if (rotated) StoreBf16x8(vector, out);

  const int32_t slot = p.slots[token];
  if (head < p.num_heads || slot < 0) return;
  const bool is_key = rotated;
  const int kv_head = is_key ? head - p.num_heads : head - q_and_k;
  const int64_t block = slot / p.block_tokens;
  const int row = slot % p.block_tokens;
  const int64_t dest =
      ((block * p.num_kv_heads + kv_head) * p.block_tokens + row) * kHeadDim + 8 * lane;
  StoreBf16x8((is_key ? p.key_pool : p.value_pool) + dest, is_key ? out : x);
}

Status ValidateQkRopeAppendParams(const QkRopeAppendParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status QkNormRopeAppend(const QkRopeAppendParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidateQkRopeAppendParams(params));
  if (params.tokens == 0) return Status::Ok();
  RUBATO_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, {
    constexpr int kHeadsPerBlock = kThreads / (kHeadDim / 8);
    const int heads = params.num_heads + 2 * params.num_kv_heads;
    const dim3 grid(static_cast<unsigned>(params.tokens),
                    static_cast<unsigned>((heads + kHeadsPerBlock - 1) / kHeadsPerBlock));
    LaunchPdl(QkRopeAppendKernel<kHeadDim>, grid, dim3(kThreads), 0, stream, params);
    return LaunchStatus("QkRopeAppendKernel");
  });
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status ValidateQkRopeAppendParams(const QkRopeAppendParams& p) {
  const std::string op = "CUDA QkNormRopeAppend: ";
  if (p.tokens < 0) return InvalidArgumentError(op + "tokens is " + std::to_string(p.tokens));
  if (p.num_heads <= 0 || p.num_kv_heads <= 0) {
    return InvalidArgumentError(op + "num_heads " + std::to_string(p.num_heads) +
                                " and num_kv_heads " + std::to_string(p.num_kv_heads) +
                                " must be positive");
  }
  if (p.head_dim < 16 || p.head_dim % 16 != 0) {
    return InvalidArgumentError(op + "head_dim is " + std::to_string(p.head_dim) +
                                "; it must be a positive multiple of 16");
  }
  const int64_t width = static_cast<int64_t>(p.num_heads + 2 * p.num_kv_heads) * p.head_dim;
  if (p.row_stride % 8 != 0 || p.row_stride < width) {
    return InvalidArgumentError(op + "row_stride is " + std::to_string(p.row_stride) +
                                "; it must be a multiple of 8 and at least (heads + 2 kv_heads) "
                                "* head_dim = " +
                                std::to_string(width));
  }
  if ((p.q_norm_weight == nullptr) != (p.k_norm_weight == nullptr)) {
    return InvalidArgumentError(op +
                                "q_norm_weight and k_norm_weight must both be set or both "
                                "be null");
  }
  if (!(p.eps >= 0.0f)) return InvalidArgumentError(op + "eps must be >= 0");
  if (p.block_tokens <= 0) {
    return InvalidArgumentError(op + "block_tokens is " + std::to_string(p.block_tokens));
  }
  if (p.tokens == 0) return Status::Ok();
  if (p.tokens > 0x7fffffff) return InvalidArgumentError(op + "too many tokens for one launch");
  if (p.qkv == nullptr || p.positions == nullptr || p.inv_freq == nullptr || p.slots == nullptr ||
      p.key_pool == nullptr || p.value_pool == nullptr) {
    return InvalidArgumentError(op + "qkv, positions, inv_freq, slots and both pools must be set");
  }
  if (!Aligned16(p.qkv) || !Aligned16(p.key_pool) || !Aligned16(p.value_pool) ||
      (p.q_norm_weight != nullptr &&
       (!Aligned16(p.q_norm_weight) || !Aligned16(p.k_norm_weight)))) {
    return InvalidArgumentError(op +
                                "qkv, the pools and the norm weights must be 16-byte "
                                "aligned");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
