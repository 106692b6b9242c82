// The attention policies rubato knows, and validation of the config's `policy` section.
//
// Registered today: `dense` (DESIGN §4.1), `streaming_llm` (DESIGN §4.7, the sink + recent
// window baseline) and `sfi` (DESIGN §4.2, Slow-Fast Inference: parameters in sfi_policy.h,
// trigger tokens resolved there through the tokenizer: a non-special token whose text, trailing
// spaces and tabs removed, ends with a trigger string); the other sparse policies of DESIGN §4
// register here as they land. Validation happens once at start so that a typo ends the process
// with a clear message ("policy: unknown policy 'sfi2' (known: dense, streaming_llm, sfi)")
// before any weights are loaded.
//
// Callers turn a PolicyChoice into engine options with ApplyPolicy (inference_rank/engine/
// engine.h), which also resolves SFI's trigger tokens.
#pragma once

#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "inference_rank/policies/sfi_policy.h"
#include "kernels/cpu/attention_window.h"

namespace rubato {

enum class PolicyKind { kDense, kStreamingLlm, kSfi };

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
};

// Names accepted by `policy.name` / `--policy`.
std::vector<std::string> KnownPolicyNames();

// Checks the name and every parameter key of the `policy` section; errors name the section's
// source file and key path ("rubato.yaml: policy.budget: unknown key",
// "rubato.yaml: policy.recent_window: must be in [1, ...], got 0").
Result<PolicyChoice> ResolvePolicy(const PolicySection& section);

}  // namespace rubato
