// SFI's configuration (every `policy: {name: sfi}` key), its trigger tokens (a non-special
// token whose text, trailing spaces and tabs removed, ends with a trigger string) and the
// per-request schedule of slow and fast decode steps (Eq. 5 plus the T_max bound). Which kind of
// step runs is decided here; the steps are the backends' (docs/sfi.md "SFI config").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/policies/sfi/kernels/sfi_selector.h"

namespace rubato {

// Upper bound of prefill_window (W after prefill): bounds the buffers that hold the masked
// logits of the prompt's tail queries.
inline constexpr int kSfiMaxPrefillWindow = 64;

// Every parameter of `policy: {name: sfi, ...}`; the YAML key of each is its field name, with
// `budget` and the selector's hyperparameters read straight into `selector` (see
// SfiSelectorConfig for their meaning and ranges).
struct SfiPolicyConfig {
  int sink_tokens = 4;      // >= 0: first positions every fast step attends (I_sink)
  int recent_window = 256;  // >= 1: last positions, the query's own included (I_recent)
  int t_max = 64;           // >= 1: at most this many consecutive fast steps
  int prefill_window = 16;  // [1, kSfiMaxPrefillWindow]: W, tail queries of the prompt whose
                            // logits the selection after prefill uses (decode uses W = 1)
  // Non-empty strings, none ending in a space or tab (the rule above could never match it).
  // An empty list is allowed: slow steps then come only from t_max.
  std::vector<std::string> triggers = {".", "?", "!", ";", "\n"};
  // [0, 1); 0 = off. Ours, beyond the paper (docs/sfi.md, "Confidence trigger"): a fast step
  // whose token has a probability (softmax of the logits at temperature 1) below this is
  // discarded and recomputed as a slow step at the same position.
  double confidence_threshold = 0.0;
  // [0, 1]; 0 = off. The seam's fidelity guard (inference_rank/attention/fidelity_guard.h,
  // docs/fidelity.md): a fast step whose query drifted from the last slow step's (the mean over
  // layers and query heads of their cosine, RoPE taken out, below this) is discarded and
  // recomputed as a slow step.
  double fidelity_guard = 0.0;
  SfiSelectorConfig selector;  // selector.budget is K, selected positions per KV head (2048)
};

// Rows per KV head of a request's compact buffer: the sink positions, then up to `budget`
// selected ones (both backends size their buffers with it).
inline int64_t SfiCompactCapacity(const SfiPolicyConfig& config) {
  return static_cast<int64_t>(config.sink_tokens) + config.selector.budget;
}

// Reads every parameter key of an `sfi` policy section; absent keys keep the defaults above.
// Errors name the key path: "rubato.yaml: policy.t_max: must be in [1, 2147483647], got 0",
// "rubato.yaml: policy.triggers[1]: '' must not be empty", "rubato.yaml: policy.tmax: unknown
// key; did you mean 't_max'?".
// Trigger strings arrive as YAML gives them ("\n" in double quotes is a newline).
Result<SfiPolicyConfig> ParseSfiPolicyConfig(const PolicySection& section);

// The same checks for a config built in code ("SfiPolicyConfig.t_max = 0 is outside [1, inf)"),
// including ValidateSfiSelectorConfig. InvalidArgument on the first bad field.
Status ValidateSfiPolicyConfig(const SfiPolicyConfig& config);

// The trigger set T_trig of the rule above: ids in [0, tokenizer.vocab_size()), sorted, unique.
// Special tokens (Tokenizer::IsSpecialToken) and ids the tokenizer does not know never match;
// added tokens that are not special do. A trigger split over several byte tokens (a multi-byte
// character the vocabulary has no whole token for) matches none of them: each decodes to U+FFFD
// alone. InvalidArgument naming the string when a trigger is empty, ends in a space or tab, or
// matches no token. Reads the whole vocabulary: call once at start, not per request.
Result<std::vector<int>> ResolveTriggerTokens(const Tokenizer& tokenizer,
                                              std::span<const std::string> triggers);

enum class SfiStepKind {
  kSlow,  // dense attention over the prefix + Selector: refreshes the selected set
  kFast,  // sparse attention over sink + recent + selected; the selected set is reused
};

// The step schedule of one request (Eq. 5 plus the T_max bound): the first decode step is slow
// (as is every step until a slow one has been reported); later, a step is slow when the token the
// previous step generated is a trigger, or when t_max fast steps have run since the last slow step
// (so never more than t_max fast steps in a row), or when the previous step was a fast one that
// the caller discarded (OnFastStepDiscarded); otherwise it is fast. A token that is a trigger
// and the t_max bound falling due on the same step give one slow step, after which both counts
// restart.
//
// Decode steps only: the prefill forward and the token it samples are not reported (the first
// decode step is slow whatever that token is). Cheap to copy; not thread-safe.
class SfiSchedule {
 public:
  // trigger_ids: sorted ascending (ResolveTriggerTokens' result), not owned; it must outlive
  // the schedule. nullptr means no triggers. t_max <= 0 makes every step slow.
  explicit SfiSchedule(int t_max, const std::vector<int>* trigger_ids);

  // The kind of the next decode step.
  SfiStepKind NextStep() const;

  // Reports the decode step that just ran and the token it generated. `executed` is normally
  // NextStep(); a caller may run a slow step when a fast one was due (the counts restart as
  // after any slow step). Any token id is accepted; ids outside the trigger set are ordinary.
  void OnStep(SfiStepKind executed, int generated_token);

  // Reports that the fast step that just ran was thrown away instead (the confidence trigger:
  // its token was too improbable); the next step is slow and recomputes the same position.
  void OnFastStepDiscarded();

  // Steps reported so far, by kind (for metrics and logs); discarded fast steps count in
  // discarded_steps() only.
  int64_t slow_steps() const { return slow_steps_; }
  int64_t fast_steps() const { return fast_steps_; }
  int64_t discarded_steps() const { return discarded_steps_; }

 private:
  int t_max_;
  const std::vector<int>* trigger_ids_;  // sorted; nullptr: none
  int64_t fast_since_slow_ = 0;          // fast steps since the last slow one
  bool previous_is_trigger_ = false;     // the last generated token is a trigger
  bool redo_ = false;                    // the last fast step was discarded
  int64_t slow_steps_ = 0;
  int64_t fast_steps_ = 0;
  int64_t discarded_steps_ = 0;
};

}  // namespace rubato
