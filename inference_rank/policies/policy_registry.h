// The attention policies rubato knows, and validation of the config's `policy` section.
//
// Registered today: `dense` (DESIGN §4.1), `streaming_llm` (DESIGN §4.7, the sink + recent
// window baseline), `offload_dense` and `offload_topk` (issue #6: the KV on a cache rank, which
// returns every position or the exact top-k of the current query; the sequential baseline that
// AsyncSpade later removes) and `sfi` (DESIGN §4.2, Slow-Fast Inference: parameters in sfi_policy.h,
// trigger tokens resolved there through the tokenizer: a non-special token whose text, trailing
// spaces and tabs removed, ends with a trigger string); the other sparse policies of DESIGN §4
// register here as they land. Validation happens once at start so that a typo ends the process
// with a clear message ("policy: unknown policy 'sfi2' (known: dense, streaming_llm, sfi)")
// before any weights are loaded.
//
// Callers turn a PolicyChoice into engine options with ApplyPolicy (inference_rank/engine/
// engine.h), which also resolves SFI's trigger tokens.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "common/config.h"
#include "common/status.h"
#include "inference_rank/policies/sfi_policy.h"
#include "kernels/cpu/attention_window.h"

namespace rubato {

enum class PolicyKind { kDense, kStreamingLlm, kSfi, kOffloadDense, kOffloadTopK };

// Parameters of `streaming_llm` and their defaults.
inline constexpr int kDefaultSinkTokens = 4;      // policy.sink_tokens, >= 0
inline constexpr int kDefaultRecentWindow = 256;  // policy.recent_window, >= 1

// A validated policy choice with its parameters.
struct PolicyChoice {
  PolicyKind kind = PolicyKind::kDense;
  std::string name;
  // The keys every query attends (the engine passes it to each forward): dense for `dense`;
  // {sink_tokens, recent_window} for `streaming_llm`; dense for `sfi`, whose prefill and slow
  // steps are dense and whose fast steps attend the sets of `sfi` (no fixed window).
  AttentionWindow window;
  // The parameters of `sfi`; default-constructed for the other policies.
  SfiPolicyConfig sfi;
  // `offload_dense` / `offload_topk`: the KV lives on a cache rank (cache_rank/cache_selector.h):
  // dense returns every position, topk the sink + exact top_k of the current query + the
  // recent window read locally. Parameters of offload_topk: top_k (2048), sink_tokens (4),
  // recent_window (256). Unset for the other policies.
  std::optional<CacheSelectorSpec> offload;
};

// Names accepted by `policy.name` / `--policy`.
std::vector<std::string> KnownPolicyNames();

// Checks the name and every parameter key of the `policy` section; errors name the section's
// source file and key path ("rubato.yaml: policy.budget: unknown key",
// "rubato.yaml: policy.recent_window: must be in [1, ...], got 0").
Result<PolicyChoice> ResolvePolicy(const PolicySection& section);

}  // namespace rubato
