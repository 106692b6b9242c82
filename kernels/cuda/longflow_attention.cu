// LongFlow's fused attention and eviction choice (see longflow_attention.cuh). One block of 8
// warps per (KV head, sequence). Pass 1: a warp takes 4 slots at a time (their rows loaded
// before use), the group's scores are reduced with warp shuffles, e = exp(s) without a running
// maximum, the warp accumulates e v and e, and lane 0 stores each slot's e per query head and
// its ||v||_1 in the workspace; a score past the limit flags the block, which then finds each
// head's maximum and runs the pass again with it subtracted. The warps merge in shared memory
// (the output), then the threads score the slots and reduce the next write slot.
#include <cfloat>
#include <climits>
#include <cmath>
#include <string>

#include "kernels/cpu/longflow_attention.h"
#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/longflow_attention.cuh"

namespace rubato::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;
constexpr float kLog2e = 1.4426950408889634f;

template <int kHeadDim, int kGroup>
struct Slots {
  const __nv_bfloat16* keys;    // [budget][head_dim] of this (sequence, KV head)
  const __nv_bfloat16* values;  // [budget][head_dim]
  const uint8_t* valid;         // [budget]
  float* weights;               // workspace [kGroup][budget]
  float* norms;                 // workspace [budget]
  int budget;
};

// Pass over every valid slot: per warp the group's sum of e = exp2(s - shift) and of e v (this
// lane's dimensions); e and ||v||_1 of each slot into the workspace. Returns through `overflow`
// whether a score (log2 units) passed the plain-exponential limit.
template <int kHeadDim, int kGroup>
__device__ void Pass(const Slots<kHeadDim, kGroup>& s, const float (&q)[kGroup][kHeadDim / 32],
                     const float (&shift)[kGroup], float (&acc)[kGroup][kHeadDim / 32],
                     float (&l)[kGroup], bool& overflow) {
  constexpr int kPerLane = kHeadDim / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const float limit = kLongFlowPlainExpLimit * kLog2e;
  for (int g = 0; g < kGroup; ++g) {
    l[g] = 0.f;
    for (int e = 0; e < kPerLane; ++e) acc[g][e] = 0.f;
  }
  for (int i0 = warp * kUnroll; i0 < s.budget; i0 += kWarps * kUnroll) {
    float k[kUnroll][kPerLane], v[kUnroll][kPerLane];
    bool use[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = min(i0 + u, s.budget - 1);
      use[u] = i0 + u < s.budget && s.valid[i] != 0;
      const size_t row = static_cast<size_t>(i) * kHeadDim + lane * kPerLane;
      LoadBf16xN<kPerLane>(s.keys + row, k[u]);
      LoadBf16xN<kPerLane>(s.values + row, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!use[u]) continue;  // warp-uniform
      float norm = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) norm += fabsf(v[u][e]);
#pragma unroll
      for (int step = 16; step > 0; step >>= 1) norm += __shfl_xor_sync(0xffffffffu, norm, step);
      if (lane == 0) s.norms[i0 + u] = norm;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        float score = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) score += q[g][e] * k[u][e];
#pragma unroll
        for (int step = 16; step > 0; step >>= 1) {
          score += __shfl_xor_sync(0xffffffffu, score, step);
        }
        overflow = overflow || score > limit;
        const float weight = exp2f(score - shift[g]);
        l[g] += weight;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) acc[g][e] += weight * v[u][e];
        if (lane == 0) s.weights[static_cast<size_t>(g) * s.budget + i0 + u] = weight;
      }
    }
  }
}

template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kThreads) LongFlowKernel(LongFlowAttentionParams p) {
  constexpr int kPerLane = kHeadDim / 32;
  const int kv_head = blockIdx.x;
  const int b = blockIdx.y;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const size_t first_slot = (static_cast<size_t>(b) * p.num_kv_heads + kv_head) * p.budget;
  float* workspace = static_cast<float*>(p.workspace);
  const Slots<kHeadDim, kGroup> slots{
      p.keys + first_slot * kHeadDim,
      p.values + first_slot * kHeadDim,
      p.valid + static_cast<size_t>(b) * p.budget,
      workspace + (static_cast<size_t>(b) * p.num_heads + kv_head * kGroup) * p.budget,
      workspace + static_cast<size_t>(p.batch) * p.num_heads * p.budget + first_slot,
      p.budget};
  float q[kGroup][kPerLane];
  for (int g = 0; g < kGroup; ++g) {
    const __nv_bfloat16* row =
        p.q + b * p.q_row_stride + static_cast<int64_t>(kv_head * kGroup + g) * kHeadDim;
    LoadBf16xN<kPerLane>(row + lane * kPerLane, q[g]);
    for (int e = 0; e < kPerLane; ++e) q[g][e] *= p.scale * kLog2e;
  }

  __shared__ int any_overflow;
  __shared__ float shared_max[kWarps][kGroup];
  __shared__ float shared_l[kWarps][kGroup];
  __shared__ float shared_acc[kWarps][kGroup][kHeadDim];
  __shared__ float z[kGroup];
  if (threadIdx.x == 0) any_overflow = 0;
  __syncthreads();
  float shift[kGroup], acc[kGroup][kPerLane], l[kGroup];
  for (int g = 0; g < kGroup; ++g) shift[g] = 0.f;
  bool overflow = false;
  Pass<kHeadDim, kGroup>(slots, q, shift, acc, l, overflow);
  if (overflow && lane == 0) atomicOr(&any_overflow, 1);
  __syncthreads();
  const bool fallback = any_overflow != 0;  // block-uniform
  if (fallback) {
    // Each head's largest score over the valid slots, then the pass with it subtracted.
    float local[kGroup];
    for (int g = 0; g < kGroup; ++g) local[g] = -INFINITY;
    for (int i = warp; i < p.budget; i += kWarps) {
      if (!slots.valid[i]) continue;
      float k[kPerLane];
      LoadBf16xN<kPerLane>(slots.keys + static_cast<size_t>(i) * kHeadDim + lane * kPerLane, k);
      for (int g = 0; g < kGroup; ++g) {
        float score = 0.f;
        for (int e = 0; e < kPerLane; ++e) score += q[g][e] * k[e];
        for (int step = 16; step > 0; step >>= 1) {
          score += __shfl_xor_sync(0xffffffffu, score, step);
        }
        local[g] = fmaxf(local[g], score);
      }
    }
    if (lane == 0) {
      for (int g = 0; g < kGroup; ++g) shared_max[warp][g] = local[g];
    }
    __syncthreads();
    for (int g = 0; g < kGroup; ++g) {
      shift[g] = -INFINITY;
      for (int w = 0; w < kWarps; ++w) shift[g] = fmaxf(shift[g], shared_max[w][g]);
      if (shift[g] == -INFINITY) shift[g] = 0.f;
    }
    Pass<kHeadDim, kGroup>(slots, q, shift, acc, l, overflow);
  }

  // The group's output: the warps' sums merged, divided by Z.
  for (int g = 0; g < kGroup; ++g) {
    if (lane == 0) shared_l[warp][g] = l[g];
    for (int e = 0; e < kPerLane; ++e) shared_acc[warp][g][lane * kPerLane + e] = acc[g][e];
  }
  __syncthreads();
  if (threadIdx.x < kGroup) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += shared_l[w][threadIdx.x];
    z[threadIdx.x] = total;
  }
  __syncthreads();
  for (int item = threadIdx.x; item < kGroup * kHeadDim; item += kThreads) {
    const int g = item / kHeadDim;
    const int d = item % kHeadDim;
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) sum += shared_acc[w][g][d];
    p.out[b * p.out_row_stride + static_cast<int64_t>(kv_head * kGroup + g) * kHeadDim + d] =
        __float2bfloat16(z[g] > 0.f ? sum / z[g] : 0.f);
  }

  // Scores and the next slot: the lowest free slot, else the least score past the sinks (ties
  // to the lower slot), by a block reduction on (score, slot).
  __shared__ float best_score[kThreads];
  __shared__ int best_slot[kThreads];
  __shared__ int free_slot;
  if (threadIdx.x == 0) free_slot = INT_MAX;
  __syncthreads();
  float my_score = INFINITY;
  int my_slot = INT_MAX;
  for (int i = threadIdx.x; i < p.budget; i += kThreads) {
    float score = 0.f;
    if (slots.valid[i]) {
      float alpha = 0.f;
      for (int g = 0; g < kGroup; ++g) {
        alpha += z[g] > 0.f ? slots.weights[static_cast<size_t>(g) * p.budget + i] / z[g] : 0.f;
      }
      score = alpha / kGroup * slots.norms[i];
      if (i >= p.sink_slots && (score < my_score || (score == my_score && i < my_slot))) {
        my_score = score;
        my_slot = i;
      }
    } else {
      atomicMin(&free_slot, i);
    }
    if (p.slot_scores != nullptr) p.slot_scores[first_slot + i] = score;
  }
  best_score[threadIdx.x] = my_score;
  best_slot[threadIdx.x] = my_slot;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      const float other = best_score[threadIdx.x + half];
      const int other_slot = best_slot[threadIdx.x + half];
      if (other < best_score[threadIdx.x] ||
          (other == best_score[threadIdx.x] && other_slot < best_slot[threadIdx.x])) {
        best_score[threadIdx.x] = other;
        best_slot[threadIdx.x] = other_slot;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const size_t at = static_cast<size_t>(b) * p.num_kv_heads + kv_head;
    p.next_slot[at] = free_slot != INT_MAX      ? free_slot
                      : best_slot[0] != INT_MAX ? best_slot[0]
                                                : -1;
    if (p.used_max != nullptr) p.used_max[at] = fallback ? 1 : 0;
  }
}

template <int kHeadDim, int kGroup>
Status Launch(const LongFlowAttentionParams& p, cudaStream_t stream) {
  if constexpr (kHeadDim < 32) {
    return UnsupportedError("longflow attention: head_dim " + std::to_string(kHeadDim) +
                            " (supported: 32, 64, 128)");
  } else {
    LongFlowKernel<kHeadDim, kGroup><<<dim3(p.num_kv_heads, p.batch), kThreads, 0, stream>>>(p);
    return LaunchStatus("longflow attention kernel");
  }
}

}  // namespace

size_t LongFlowAttentionWorkspaceBytes(int batch, int num_heads, int budget) {
  // e per (query head, slot) and ||v||_1 per (KV head, slot) (KV heads <= query heads).
  return static_cast<size_t>(batch) * 2 * num_heads * budget * sizeof(float);
}

Status LongFlowAttention(const LongFlowAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0) return Status::Ok();
  if (p.batch < 0 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0 || p.budget < 1 ||
      p.sink_slots < 0 || p.sink_slots > p.budget) {
    return InvalidArgumentError(
        "longflow attention: bad shape (batch " + std::to_string(p.batch) + ", heads " +
        std::to_string(p.num_heads) + "/" + std::to_string(p.num_kv_heads) + ", budget " +
        std::to_string(p.budget) + ", sinks " + std::to_string(p.sink_slots) + ")");
  }
  if (p.q == nullptr || p.keys == nullptr || p.values == nullptr || p.valid == nullptr ||
      p.out == nullptr || p.next_slot == nullptr || p.workspace == nullptr) {
    return InvalidArgumentError("longflow attention: a required pointer is null");
  }
  const size_t needed = LongFlowAttentionWorkspaceBytes(p.batch, p.num_heads, p.budget);
  if (p.workspace_bytes < needed) {
    return InvalidArgumentError("longflow attention: workspace of " +
                                std::to_string(p.workspace_bytes) + " bytes, " +
                                std::to_string(needed) + " needed");
  }
  const int group = p.num_heads / p.num_kv_heads;
  RUBATO_DISPATCH_HEAD_DIM(p.head_dim, kHeadDim, {
    RUBATO_DISPATCH_GQA_GROUP(group, kGroup, { return Launch<kHeadDim, kGroup>(p, stream); });
  });
}

}  // namespace rubato::cuda
