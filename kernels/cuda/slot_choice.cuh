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

namespace rubato::cuda::decode_attention {

// One (sequence, KV head)'s inputs and outputs.
struct SlotChoiceRow {
  const float* scores = nullptr;  // the group's first head's raw scores (log2 units)
  int64_t head_stride = 0;        // between the group's heads' score rows
  const float* norms = nullptr;   // [budget] ||v||_1
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
// log-sum-exp in log2 units (-inf: nothing attended).
template <int kGroup, int kBlockThreads>
__device__ void ChooseSlot(const SlotChoiceRow& row, const float (&lse2)[kGroup]) {
  constexpr int kBlockWarps = kBlockThreads / 32;
  constexpr float kLn2 = 0.6931471805599453f;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  SlotCandidate best{INFINITY, INT_MAX};
  int free_slot = INT_MAX;
  float largest = -INFINITY;  // the group's largest raw score (log2 units)
  for (int i = threadIdx.x; i < row.budget; i += kBlockThreads) {
    float score = 0.f;
    if (row.valid[i]) {
      float alpha = 0.f;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const float s = row.scores[g * row.head_stride + i];
        largest = fmaxf(largest, s);
        if (lse2[g] != -INFINITY) alpha += exp2f(s - lse2[g]);
      }
      score = alpha / kGroup * row.norms[i];
      if (i >= row.sink_slots) best = BetterSlot(best, SlotCandidate{score, i});
    } else {
      free_slot = min(free_slot, i);
    }
    if (row.choice_scores != nullptr) row.choice_scores[i] = score;
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

// The (sequence, KV head) of a slot launch: its slot array (its own, or its array in a pool).
__device__ inline int SlotArrayOf(const DecodeAttentionParams& params, int sequence) {
  return params.slot_arrays == nullptr
             ? sequence
             : min(max(params.slot_arrays[sequence], 0), params.num_slot_arrays - 1);
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
