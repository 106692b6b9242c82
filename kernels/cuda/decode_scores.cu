// Scores-only decode pass (see decode_scores.cuh): one block of 4 warps per (chunk of positions,
// KV head, sequence); a warp takes 4 positions at a time (their key rows loaded before use), a
// lane holds head_dim / 32 dimensions of the GQA group's queries and of the row, the dot products
// are reduced with warp shuffles and lane 0 writes the group's scores of the position.
#include <algorithm>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_scores.cuh"
#include "kernels/cuda/dispatch.cuh"

namespace rubato::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;
constexpr int kChunk = 512;  // positions per block
constexpr float kLog2e = 1.4426950408889634f;

template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kThreads) DecodeScoresKernel(DecodeScoresParams p) {
  constexpr int kPerLane = kHeadDim / 32;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int length = min(p.seq_lens[b], p.max_seq_len);
  const int begin = blockIdx.x * kChunk;
  const int end = min(begin + kChunk, length);
  if (begin >= end) return;
  float q[kGroup][kPerLane];
  for (int g = 0; g < kGroup; ++g) {
    const __nv_bfloat16* row =
        p.q + b * p.q_row_stride + static_cast<int64_t>(kv_head * kGroup + g) * kHeadDim;
    float raw[kPerLane];
    LoadBf16xN<kPerLane>(row + lane * kPerLane, raw);
    for (int e = 0; e < kPerLane; ++e) q[g][e] = raw[e];
  }
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.block_table_stride;
  float* out =
      p.scores + (static_cast<int64_t>(b) * p.num_heads + kv_head * kGroup) * p.scores_stride;
  for (int i0 = begin + warp * kUnroll; i0 < end; i0 += kWarps * kUnroll) {
    float k[kUnroll][kPerLane];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int position = min(i0 + u, end - 1);
      const int64_t block = table[position / p.block_tokens];
      LoadBf16xN<kPerLane>(
          p.key_pool +
              ((block * p.num_kv_heads + kv_head) * p.block_tokens + position % p.block_tokens) *
                  kHeadDim +
              lane * kPerLane,
          k[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u >= end) continue;  // warp-uniform
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) s += q[g][e] * k[u][e];
#pragma unroll
        for (int step = 16; step > 0; step >>= 1) s += __shfl_xor_sync(0xffffffffu, s, step);
        // The CPU twin's rounding: the fp32 dot, times the scale, times log2 e.
        if (lane == 0) out[g * p.scores_stride + i0 + u] = s * p.scale * kLog2e;
      }
    }
  }
}

template <int kHeadDim, int kGroup>
Status Launch(const DecodeScoresParams& p, cudaStream_t stream) {
  if constexpr (kHeadDim < 32) {
    return UnsupportedError("decode scores: head_dim " + std::to_string(kHeadDim) +
                            " (supported: 32, 64, 128)");
  } else {
    const dim3 grid((p.max_seq_len + kChunk - 1) / kChunk, p.num_kv_heads, p.batch);
    DecodeScoresKernel<kHeadDim, kGroup><<<grid, kThreads, 0, stream>>>(p);
    return LaunchStatus("decode scores kernel");
  }
}

}  // namespace

Status DecodeScores(const DecodeScoresParams& p, cudaStream_t stream) {
  if (p.batch == 0) return Status::Ok();
  if (p.batch < 0 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0 || p.max_seq_len < 1 ||
      p.scores_stride < p.max_seq_len || p.block_tokens < 1) {
    return InvalidArgumentError(
        "decode scores: bad shape (batch " + std::to_string(p.batch) + ", heads " +
        std::to_string(p.num_heads) + "/" + std::to_string(p.num_kv_heads) + ", max_seq_len " +
        std::to_string(p.max_seq_len) + ", stride " + std::to_string(p.scores_stride) + ")");
  }
  if (p.q == nullptr || p.key_pool == nullptr || p.block_tables == nullptr ||
      p.seq_lens == nullptr || p.scores == nullptr) {
    return InvalidArgumentError("decode scores: a required pointer is null");
  }
  const int group = p.num_heads / p.num_kv_heads;
  RUBATO_DISPATCH_HEAD_DIM(p.head_dim, kHeadDim, {
    RUBATO_DISPATCH_GQA_GROUP(group, kGroup, { return Launch<kHeadDim, kGroup>(p, stream); });
  });
}

}  // namespace rubato::cuda
