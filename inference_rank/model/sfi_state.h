// SFI (Slow-Fast Inference, DESIGN §4.2) as a model sees it: what one forward entry asks for,
// and the per-request state a slow step writes and fast steps read.
//
// Per (request, layer, KV head) the working set is sink ∪ selected ∪ recent:
//   * sink: positions [0, min(sink_tokens, L));
//   * selected: up to `budget` positions the Selector (kernels/cpu/sfi_selector.h) chose at the
//     last slow step from the allowed set J = [sink_end, anchor), with L_slow the sequence
//     length at that slow step, sink_end = min(sink_tokens, L_slow) and anchor =
//     max(sink_end, L_slow - recent_window) (SfiSinkEnd / SfiAnchor below);
//   * recent: [anchor, L), read in place from the paged cache.
// Sink and selected K/V are gathered into a compact buffer [kv_head][capacity][head_dim] at the
// slow step; a fast step attends (compact segment, recent segment) in one two-segment call.
//
// Our choice where the paper lets the recent window slide at fixed width between slow steps:
// the recent segment stays anchored at the last slow step's J end and grows by one position per
// fast step (at most t_max positions past recent_window). Positions that slide out of a
// fixed-width window after a selection would otherwise be attended by no segment until the next
// slow step; anchoring keeps every position the selection did not rank, costs at most t_max
// extra keys per head, and makes SFI with budget >= |J| attend exactly what dense attends.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "inference_rank/policies/sfi_policy.h"

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
  std::vector<SfiLayerState> layers;  // [num_layers]; empty until the first slow step
  int anchor = 0;                     // recent segment start: J's end at the last slow step
  bool has_selection = false;         // a slow step has completed
  std::unique_ptr<SfiBackendHandle> backend;  // the backend's resources (see above), or null
};

// ForwardEntry::sfi: how this entry attends in this forward.
struct SfiForward {
  // kSlow: dense attention, then the Selector refreshes every layer's selection; kFast:
  // two-segment attention over the state of the last slow step (one decode token).
  SfiStepKind step = SfiStepKind::kSlow;
  SfiSequenceState* state = nullptr;       // written by a slow step, read by a fast one
  const SfiPolicyConfig* config = nullptr;  // sink, recent window, budget, selector
  // Slow steps: the entry's last `window_queries` tokens are the Selector's W queries (1 for a
  // decode token; up to config->prefill_window for the chunk that ends a prompt).
  int window_queries = 1;
};

}  // namespace rubato
