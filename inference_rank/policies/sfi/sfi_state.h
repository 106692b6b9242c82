// SFI's per-request state and how an SFI step reads as a forward entry's plan. Per (request,
// layer, KV head) the working set is sink [0, sink_end) + selected (from J = [sink_end,
// anchor) at the last slow step) + recent [anchor, L), the recent segment anchored at the last
// slow step (our choice; docs/sfi.md "SFI state").
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "inference_rank/attention/fidelity_guard.h"
#include "inference_rank/attention/layer_action.h"
#include "inference_rank/policies/sfi/sfi_config.h"

namespace rubato {

// The segments of a sequence of `length` positions at a slow step (see the file comment).
inline int SfiSinkEnd(const SfiPolicyConfig& config, int length) {
  return std::min(config.sink_tokens, length);
}
inline int SfiAnchor(const SfiPolicyConfig& config, int length) {
  return std::max(SfiSinkEnd(config, length), length - config.recent_window);
}

// One (request, layer)'s selection. Every backend sets `counts` at a slow step (the engine's
// retained-KV ratio reads them); the CPU model also keeps the positions and the compact buffer
// here, while the CUDA model keeps them in its device pool (SfiBackendHandle) and leaves `kept`
// and the compact vectors empty.
struct SfiLayerState {
  std::vector<std::vector<int>> kept;  // [kv_head] sink positions then selected, ascending (CPU)
  std::vector<int> counts;             // [kv_head] rows of the compact buffer: sink + selected
  // CPU backend: the compact buffer, rows 0..counts[h]-1 of head h valid, f32.
  std::vector<float> compact_keys;    // [kv_head][capacity][head_dim]
  std::vector<float> compact_values;  // [kv_head][capacity][head_dim]
};

// What a backend holds for one request beyond SfiSequenceState's host fields: the CUDA model's
// slot in its device pool of compact buffers (cuda_sfi_pool.h). The backend creates it at the
// request's first slow step; destroying it (with the state, when the engine retires the
// request) gives the slot back, so a pool sized for max_batch requests never runs out while at
// most max_batch run. Null for the CPU model.
class SfiBackendHandle {
 public:
  virtual ~SfiBackendHandle() = default;
};

// One request's SFI state, owned by the engine for the request's lifetime. Move-only.
struct SfiSequenceState {
  std::vector<SfiLayerState> layers;          // [num_layers]; empty until the first slow step
  int anchor = 0;                             // recent segment start: J's end at the last slow step
  bool has_selection = false;                 // a slow step has completed
  std::unique_ptr<SfiBackendHandle> backend;  // the backend's resources (see above), or null
  // policy.fidelity_guard > 0: each layer's query at the last slow step (the CPU backend keeps
  // them here, the CUDA backend in its pool slot), the current fast step's cosines against them
  // summed over its layers (the CUDA backend copies its device sum back here), and whether their
  // mean fell below the threshold (the step is then recomputed as a slow one).
  QueryDriftGuard guard;
  double guard_cosine_sum = 0.0;
  bool guard_fired = false;
};

// How an SFI step reads as a forward entry's attention (ForwardEntry::attention), which both
// SFI backends read back:
//   slow: kDense emitting raw scores over J from the entry's last `window_queries` queries
//         (1 for a decode token; up to prefill_window for the chunk that ends a prompt), then
//         the Selector refreshes every layer's selection; row group kSfiSlowRows;
//   fast: kTwoSegment over the state's compact rows and [anchor, L); row group kSfiFastRows.
inline constexpr int kSfiFastRows = 1;  // the CUDA plan's row groups: fast rows first
inline constexpr int kSfiSlowRows = 2;

inline EntryAttention SfiStep(SfiStepKind step, SfiSequenceState* state, int window_queries = 1) {
  EntryAttention attention;
  attention.state = state;
  attention.window_queries = window_queries;
  if (step == SfiStepKind::kFast) {
    attention.action.op = AttentionOp::kTwoSegment;
    attention.action.recent_begin = state->anchor;
    attention.row_group = kSfiFastRows;
  } else {
    attention.action.op = AttentionOp::kDense;
    attention.action.evidence = kRawScores;
    attention.row_group = kSfiSlowRows;
  }
  return attention;
}
// Whether a plan is one SfiStep made (its op, evidence and row group), and of which kind.
inline bool IsSfiFastPlan(const EntryAttention& a) {
  return a.action.op == AttentionOp::kTwoSegment && a.row_group == kSfiFastRows;
}
inline bool IsSfiSlowPlan(const EntryAttention& a) {
  return a.action.op == AttentionOp::kDense && a.action.evidence == kRawScores &&
         a.row_group == kSfiSlowRows;
}
inline SfiStepKind SfiStepOf(const EntryAttention& attention) {
  return attention.action.op == AttentionOp::kTwoSegment ? SfiStepKind::kFast : SfiStepKind::kSlow;
}
inline SfiSequenceState& SfiStateOf(const EntryAttention& attention) {
  return *static_cast<SfiSequenceState*>(attention.state);
}

}  // namespace rubato
