// What one forward entry's attention does in every layer: the read-only plan a policy's host
// half writes before a step and the model executes (docs/attention_seam.md). The model runs
// the op; the operands a policy owns (compact rows, evidence buffers) come from its backend
// half (cpu_backend.h, cuda_backend.h). An entry without an EntryAttention attends densely
// through the forward's window.
#pragma once

#include <cstdint>

namespace rubato {

enum class AttentionOp : uint8_t {
  kDense,        // every position the forward's window allows (prefill and decode)
  kTwoSegment,   // one decode token: compact rows of the backend, then [recent_begin, L) in place
  kIndexGather,  // positions another layer selected, per KV head, through a head map
  kFixedBudget,  // a static per-request slot array; the next write slot chosen on the device
};

// Evidence the action emits beside its output, for the policy's selection (bit set).
enum EvidenceBits : uint8_t {
  kNoEvidence = 0,
  kRawScores = 1,    // scale * q.k over the allowed set, per query head
  kPooledProbs = 2,  // post-softmax probabilities averaged over the GQA group, per KV head
  kSlotScores = 4,   // a score per fixed-budget slot
};

struct LayerAction {
  AttentionOp op = AttentionOp::kDense;
  uint8_t evidence = kNoEvidence;  // EvidenceBits
  int recent_begin = 0;            // kTwoSegment: first position read in place
  int source_layer = -1;           // kIndexGather: the layer whose selection is attended
};

// ForwardEntry::attention: the entry's action in every layer (or one per layer) and what the model
// hands the policy's backend untouched.
struct EntryAttention {
  LayerAction action;
  // Set: one action per layer ([num_layers]), in place of `action` (e.g. dense layer 0, then
  // layers attending other layers' selections). Must outlive the forward.
  const LayerAction* layer_actions = nullptr;
  const LayerAction& ActionFor(int layer) const {
    return layer_actions != nullptr ? layer_actions[layer] : action;
  }
  // Rows of one group run together (CUDA: one launch per group and layer); the policy's own
  // numbering, >= 1. Group 0 is the model's plain dense rows.
  int row_group = 1;
  // Evidence from the entry's last `window_queries` queries (1 for a decode token).
  int window_queries = 1;
  void* state = nullptr;  // the policy's per-request state; opaque to the model
};

}  // namespace rubato
