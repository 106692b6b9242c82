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

// One (request, layer)'s selection.
struct SfiLayerState {
  std::vector<std::vector<int>> kept;  // [kv_head] sink positions then selected, ascending
  std::vector<int> counts;             // [kv_head] kept[h].size()
  // CPU backend: the compact buffer, rows 0..counts[h]-1 of head h valid, f32.
  std::vector<float> compact_keys;    // [kv_head][capacity][head_dim]
  std::vector<float> compact_values;  // [kv_head][capacity][head_dim]
};

// One request's SFI state, owned by the engine for the request's lifetime.
struct SfiSequenceState {
  std::vector<SfiLayerState> layers;  // [num_layers]; empty until the first slow step
  int anchor = 0;                     // recent segment start: J's end at the last slow step
  bool has_selection = false;         // a slow step has completed
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
