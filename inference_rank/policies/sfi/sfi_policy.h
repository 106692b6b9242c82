// SFI, Slow-Fast Inference (docs/design.md §4.2): the policy's host half. Per request it runs the
// step schedule (sfi_config.h) and plans each entry (sfi_state.h SfiStep): the prompt's last chunk
// and slow decode steps attend densely and refresh the selection, fast steps attend sink +
// selected + recent; a fast step whose token falls below the confidence threshold is thrown
// away and recomputed as a slow step. Backend halves: sfi_cpu_backend.h, sfi_cuda_backend.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "inference_rank/attention/policy.h"
#include "inference_rank/policies/sfi/sfi_config.h"
#include "inference_rank/policies/sfi/sfi_state.h"

namespace rubato {

// Steps the requests of one policy ran.
struct SfiCounters {
  int64_t slow_steps = 0;  // entries that attended densely and refreshed a selection
  int64_t fast_steps = 0;  // entries that attended their sparse working set
  // Of fast_steps, those whose token the confidence trigger threw away (recomputed by the
  // request's next step, a slow one).
  int64_t discarded_steps = 0;
};

class SfiPolicy final : public AttentionPolicy {
 public:
  // InvalidArgument for an invalid config (ValidateSfiPolicyConfig).
  static Result<std::unique_ptr<SfiPolicy>> Create(const SfiPolicyConfig& config);

  std::string_view name() const override { return "sfi"; }
  const PolicyTraits& traits() const override;
  // ResolveTriggerTokens over the tokenizer (InvalidArgument when there are triggers and no
  // tokenizer, or a trigger matches no token).
  Status UseTokenizer(const Tokenizer* tokenizer) override;
  // The trigger ids directly (sorted, unique), as UseTokenizer would set them.
  Status SetTriggerIds(std::vector<int> trigger_ids);
  // Checks the trigger ids against the model's vocabulary, then the backend of model's type.
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model, int max_batch) const override;
  Status CheckLimits(int max_context) const override;
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override;
  // rubato:slow_steps_total, rubato:fast_steps_total, rubato:discarded_fast_steps_total.
  Status RegisterMetrics(MetricsRegistry& registry) override;
  // " sfi_slow_steps=N sfi_fast_steps=M sfi_discarded_steps=D" and, with the fidelity guard on,
  // " sfi_guard_firings=F sfi_guard_firings_per_100_steps=R" (docs/fidelity.md).
  std::string StatsLine() const override;

  const SfiPolicyConfig& config() const { return config_; }
  const std::vector<int>& trigger_ids() const { return trigger_ids_; }
  const SfiCounters& counters() const { return counters_; }
  const FidelityGuardCounters& guard_counters() const { return guard_counters_; }

 private:
  class Request;
  explicit SfiPolicy(const SfiPolicyConfig& config) : config_(config) {}
  void Count(SfiStepKind step, bool discarded);
  // A decode step under policy.fidelity_guard: `checked` a fast step the guard judged.
  void CountGuard(bool checked, bool fired);

  SfiPolicyConfig config_;
  std::vector<int> trigger_ids_;  // sorted
  SfiCounters counters_;
  FidelityGuardCounters guard_counters_;
  Counter* guard_metric_ = nullptr;
  Counter* slow_steps_metric_ = nullptr;  // in the registry, once registered
  Counter* fast_steps_metric_ = nullptr;
  Counter* discarded_steps_metric_ = nullptr;
};

// `policy: {name: sfi, ...}` (ParseSfiPolicyConfig's keys).
Result<std::unique_ptr<AttentionPolicy>> CreateSfiPolicy(const PolicySection& section);

// An SFI fast step's share of the context: (kept positions averaged over layers and KV heads +
// the recent segment [anchor, context)) / context.
double SfiRetainedKvRatio(const SfiSequenceState& state, int context);

}  // namespace rubato
