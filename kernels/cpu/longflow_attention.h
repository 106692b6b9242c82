// LongFlow's fused decode attention and eviction choice (the LongFlow paper §3.2, App. E), CPU
// reference: one query token attends its fixed-budget slots (the valid ones); from the same
// exponentials every slot's score ||alpha_i v_i||_1 (Eq. 6, alpha averaged over the GQA group)
// and, per KV head, the slot the next token writes: the lowest free slot, else the valid
// unprotected slot of least score (ties: the lower slot). No running maximum (exp in fp32) unless
// a score could overflow: then the head is recomputed with one. The CUDA twin's contract.
// Narrative and choices: docs/longflow.md "The fused kernel".
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"

namespace rubato {

// Scores above this (natural units) switch a head to the max-subtracted softmax: exp(64) times a
// budget of up to 2^20 slots stays below fp32's largest finite value.
inline constexpr float kLongFlowPlainExpLimit = 64.f;

struct LongFlowAttentionArgs {
  const float* query = nullptr;    // [num_heads][head_dim], f32 (after RoPE)
  float* output = nullptr;         // [num_heads][head_dim], f32
  int num_heads = 0;               // a multiple of num_kv_heads
  const float* keys = nullptr;     // [num_kv_heads][budget][head_dim], f32: the slots
  const float* values = nullptr;   // [num_kv_heads][budget][head_dim], f32
  const uint8_t* valid = nullptr;  // [budget]: 1 where a slot holds a token (shared by KV heads)
  int num_kv_heads = 0;
  int budget = 0;  // B >= 1
  int head_dim = 0;
  int sink_slots = 0;            // slots [0, sink_slots) are never chosen for eviction
  int32_t* next_slot = nullptr;  // [num_kv_heads] out; -1 when no slot may be written
  float* slot_scores = nullptr;  // optional [num_kv_heads][budget] out; 0 where not valid
  uint8_t* used_max = nullptr;   // optional [num_kv_heads] out: 1 where the overflow fallback ran
};

// OK when the shapes agree and the pointers are set; InvalidArgument naming the field otherwise.
Status ValidateLongFlowAttention(const LongFlowAttentionArgs& args);

// Floats of scratch one LongFlowAttentionForKvHead call needs: (group + 1) * budget.
int LongFlowAttentionScratchSize(const LongFlowAttentionArgs& args);

// The outputs of KV head `kv_head` (its query heads, its scores, its next slot); heads may run
// on different threads. `args` must have passed validation; scratch is the calling thread's.
void LongFlowAttentionForKvHead(const LongFlowAttentionArgs& args, int kv_head, float* scratch);

Status LongFlowAttention(const LongFlowAttentionArgs& args, std::span<float> scratch);

}  // namespace rubato
