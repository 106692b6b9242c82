// The eviction choice over a slot array (LongFlow, docs/longflow.md "The fused kernel"): from the
// raw scores of a KV head's GQA group, their log-sum-exps and each slot's ||v||_1, every valid
// slot's Eq. 6 score (the group's mean alpha times ||v||_1) and the slot the next token writes:
// the lowest invalid slot, else the valid slot of least score past the sinks, ties to the lower
// slot, -1 when every slot is a sink. One block per (sequence, KV head): inside the decode
// attention split kernel when one split covers the slots, else SlotChoiceKernel after the merge.
// CPU twin: kernels/cpu/longflow_attention.h.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/longflow_attention.h"  // kLongFlowPlainExpLimit
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/decode_attention_keys.cuh"  // SlotArrayOf

namespace rubato::cuda::decode_attention {

// One (sequence, KV head)'s inputs and outputs.
struct SlotChoiceRow {
  const float* scores = nullptr;  // the group's first head's raw scores (log2 units)
  int64_t head_stride = 0;        // between the group's heads' score rows
  // Optional: the scores of slots [0, near_count) are at near_scores (shared memory) instead,
  // head g's at near_scores + g * near_count; near_count is the budget or a multiple of 4.
  const float* near_scores = nullptr;
  int near_count = 0;
  const float* norms = nullptr;  // [budget] ||v||_1
  const uint8_t* valid = nullptr;
  int budget = 0;
  int sink_slots = 0;
  float* choice_scores = nullptr;  // optional [budget]: the Eq. 6 scores, 0 where invalid
  int32_t* next = nullptr;         // the next write slot
  uint8_t* used_max = nullptr;     // optional: the largest score needed the max-subtracted pass
};

struct SlotCandidate {  // the least score past the sinks so far, ties to the lower slot
  float score;
  int slot;
};

__device__ inline SlotCandidate BetterSlot(SlotCandidate a, SlotCandidate b) {
  return (b.score < a.score || (b.score == a.score && b.slot < a.slot)) ? b : a;
}

// Called by every thread of a block of kBlockThreads; lse2 holds each group head's
// log-sum-exp in log2 units (-inf: nothing attended). Reads four slots at a time (16-byte loads
// of the scores and norms) where the rows allow: the choice runs at the end of an attention
// block, and its L2 round trips, not its arithmetic, are its cost (one slot a thread at a time
// made it 10 % of the fused op at B = 2400).
template <int kGroup, int kBlockThreads>
__device__ void ChooseSlot(const SlotChoiceRow& row, const float (&lse2)[kGroup]) {
  constexpr int kBlockWarps = kBlockThreads / 32;
  constexpr float kLn2 = 0.6931471805599453f;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  SlotCandidate best{INFINITY, INT_MAX};
  int free_slot = INT_MAX;
  float largest = -INFINITY;  // the group's largest raw score (log2 units)
  // One slot: its validity, the group's raw scores and its norm.
  auto consider = [&](int i, bool valid, const float(&s)[kGroup], float norm) {
    float score = 0.f;
    if (valid) {
      float alpha = 0.f;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        largest = fmaxf(largest, s[g]);
        if (lse2[g] != -INFINITY) alpha += exp2f(s[g] - lse2[g]);
      }
      score = alpha / kGroup * norm;
      if (i >= row.sink_slots) best = BetterSlot(best, SlotCandidate{score, i});
    } else {
      free_slot = min(free_slot, i);
    }
    return score;
  };
  const auto aligned = [](const void* p, unsigned bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
  };
  const bool by_four = row.budget % 4 == 0 && row.head_stride % 4 == 0 && row.near_count % 4 == 0 &&
                       aligned(row.near_scores, 16) && aligned(row.scores, 16) &&
                       aligned(row.norms, 16) && aligned(row.valid, 4) &&
                       (row.choice_scores == nullptr || aligned(row.choice_scores, 16));
  if (by_four) {
    for (int q = threadIdx.x; q < row.budget / 4; q += kBlockThreads) {
      const uchar4 valid = reinterpret_cast<const uchar4*>(row.valid)[q];
      const float4 norm = reinterpret_cast<const float4*>(row.norms)[q];
      float4 raw[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        raw[g] = 4 * q < row.near_count
                     ? reinterpret_cast<const float4*>(row.near_scores + g * row.near_count)[q]
                     : reinterpret_cast<const float4*>(row.scores + g * row.head_stride)[q];
      }
      float s[4][kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        s[0][g] = raw[g].x;
        s[1][g] = raw[g].y;
        s[2][g] = raw[g].z;
        s[3][g] = raw[g].w;
      }
      float4 score;
      score.x = consider(4 * q, valid.x != 0, s[0], norm.x);
      score.y = consider(4 * q + 1, valid.y != 0, s[1], norm.y);
      score.z = consider(4 * q + 2, valid.z != 0, s[2], norm.z);
      score.w = consider(4 * q + 3, valid.w != 0, s[3], norm.w);
      if (row.choice_scores != nullptr) reinterpret_cast<float4*>(row.choice_scores)[q] = score;
    }
  } else {
    for (int i = threadIdx.x; i < row.budget; i += kBlockThreads) {
      float s[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        s[g] = i < row.near_count ? row.near_scores[g * row.near_count + i]
                                  : row.scores[g * row.head_stride + i];
      }
      const float score = consider(i, row.valid[i] != 0, s, row.norms[i]);
      if (row.choice_scores != nullptr) row.choice_scores[i] = score;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    best = BetterSlot(best, SlotCandidate{__shfl_xor_sync(0xffffffffu, best.score, offset),
                                          __shfl_xor_sync(0xffffffffu, best.slot, offset)});
    free_slot = min(free_slot, __shfl_xor_sync(0xffffffffu, free_slot, offset));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  __shared__ SlotCandidate warp_best[kBlockWarps];
  __shared__ int warp_free[kBlockWarps];
  __shared__ float warp_largest[kBlockWarps];
  if (lane == 0) {
    warp_best[warp] = best;
    warp_free[warp] = free_slot;
    warp_largest[warp] = largest;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kBlockWarps; ++w) {
      best = BetterSlot(best, warp_best[w]);
      free_slot = min(free_slot, warp_free[w]);
      largest = fmaxf(largest, warp_largest[w]);
    }
    *row.next = free_slot != INT_MAX ? free_slot : best.slot != INT_MAX ? best.slot : -1;
    if (row.used_max != nullptr) {
      *row.used_max = largest * kLn2 > kLongFlowPlainExpLimit ? 1 : 0;
    }
  }
}

// Everything but the log-sum-exps, from a slot launch's params. scores: its raw scores
// ([batch][num_heads][scores_stride]).
__device__ inline SlotChoiceRow SlotChoiceRowOf(const DecodeAttentionParams& params,
                                                const float* scores, int64_t scores_stride,
                                                int sequence, int kv_head, int group) {
  const int array = SlotArrayOf(params, sequence);
  const size_t pair = static_cast<size_t>(sequence) * params.num_kv_heads + kv_head;
  SlotChoiceRow row;
  row.scores =
      scores + (static_cast<size_t>(sequence) * params.num_heads + kv_head * group) * scores_stride;
  row.head_stride = scores_stride;
  row.norms = params.slot_value_norms + pair * params.slot_budget;
  row.valid = params.slot_valid + static_cast<size_t>(array) * params.slot_budget;
  row.budget = params.slot_budget;
  row.sink_slots = params.slot_sink_slots;
  row.choice_scores = params.slot_choice_scores == nullptr
                          ? nullptr
                          : params.slot_choice_scores + pair * params.slot_budget;
  row.next = params.slot_next + static_cast<size_t>(array) * params.num_kv_heads + kv_head;
  row.used_max = params.slot_used_max == nullptr ? nullptr : params.slot_used_max + pair;
  return row;
}

// The choice after the merge of several splits: one block per (KV head, sequence); lse2 is the
// merge's [batch][num_heads] log2 log-sum-exp.
template <int kGroup>
__global__ void __launch_bounds__(256)
    SlotChoiceKernel(const DecodeAttentionParams params, const float* scores, int64_t scores_stride,
                     const float* lse2) {
  const int kv_head = blockIdx.x;
  const int sequence = blockIdx.y;
  float group_lse2[kGroup];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    group_lse2[g] = lse2[static_cast<size_t>(sequence) * params.num_heads + kv_head * kGroup + g];
  }
  ChooseSlot<kGroup, 256>(SlotChoiceRowOf(params, scores, scores_stride, sequence, kv_head, kGroup),
                          group_lse2);
}

}  // namespace rubato::cuda::decode_attention
