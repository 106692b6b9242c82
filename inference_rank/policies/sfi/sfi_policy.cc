// SFI's host half: schedule, plans, the confidence trigger, counters (see sfi_policy.h).
#include "inference_rank/policies/sfi/sfi_policy.h"

#include <algorithm>
#include <utility>

#include "common/tokenizer/tokenizer.h"
#include "inference_rank/model/model.h"
#include "inference_rank/policies/sfi/sfi_cpu_backend.h"

#ifdef RUBATO_HAS_CUDA
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/sfi/sfi_cuda_backend.h"
#endif

namespace rubato {

// One request: its selection state, its schedule and the plan of its current entry.
class SfiPolicy::Request final : public PolicyRequest {
 public:
  explicit Request(SfiPolicy& policy)
      : policy_(policy), schedule_(policy.config_.t_max, &policy.trigger_ids_) {}

  const EntryAttention* PlanPrefill(int /*start_position*/, int chunk_tokens,
                                    bool last_chunk) override {
    if (!last_chunk) return nullptr;  // only the prompt's last chunk selects: its W tail queries
    planned_ = SfiStepKind::kSlow;
    entry_ = SfiStep(planned_, &state_, std::min(chunk_tokens, policy_.config_.prefill_window));
    return &entry_;
  }
  const EntryAttention* PlanDecode(int /*position*/) override {
    planned_ = state_.has_selection ? schedule_.NextStep() : SfiStepKind::kSlow;
    state_.guard_fired = false;
    entry_ = SfiStep(planned_, &state_);
    return &entry_;
  }
  bool WantsTokenProbability() const override {
    return planned_ == SfiStepKind::kFast && policy_.config_.confidence_threshold > 0.0;
  }
  Verdict Observe(bool decode, int token, float probability) override {
    if (decode && policy_.config_.fidelity_guard > 0.0) {
      policy_.CountGuard(planned_ == SfiStepKind::kFast, state_.guard_fired);
    }
    if (planned_ == SfiStepKind::kFast && state_.guard_fired) {  // the guard: a slow step now
      schedule_.OnFastStepDiscarded();
      policy_.Count(SfiStepKind::kFast, /*discarded=*/true);
      return Verdict::kRedo;
    }
    if (WantsTokenProbability() && probability < policy_.config_.confidence_threshold) {
      schedule_.OnFastStepDiscarded();
      policy_.Count(SfiStepKind::kFast, /*discarded=*/true);
      return Verdict::kRedo;
    }
    policy_.Count(planned_, /*discarded=*/false);
    // The schedule counts decode steps; the prompt's selection is not one of them.
    if (decode) schedule_.OnStep(planned_, token);
    last_ = planned_;
    return Verdict::kAccept;
  }
  double RetainedKvRatio(int context) const override {
    return last_ == SfiStepKind::kFast ? SfiRetainedKvRatio(state_, context) : 1.0;
  }

 private:
  SfiPolicy& policy_;
  SfiSchedule schedule_;
  SfiSequenceState state_;  // its backend handle gives a CUDA pool slot back when it goes
  EntryAttention entry_;
  SfiStepKind planned_ = SfiStepKind::kSlow;
  SfiStepKind last_ = SfiStepKind::kSlow;
};

Result<std::unique_ptr<SfiPolicy>> SfiPolicy::Create(const SfiPolicyConfig& config) {
  RUBATO_RETURN_IF_ERROR(ValidateSfiPolicyConfig(config).WithContext("policy sfi"));
  return std::unique_ptr<SfiPolicy>(new SfiPolicy(config));
}

const PolicyTraits& SfiPolicy::traits() const {
  // Offloaded KV would need the slow step's selection on the cache rank: not built yet.
  static const PolicyTraits traits{ResidencySet{KvResidency::kLocal}, true};
  return traits;
}

Status SfiPolicy::UseTokenizer(const Tokenizer* tokenizer) {
  trigger_ids_.clear();
  if (config_.triggers.empty()) return Status::Ok();
  if (tokenizer == nullptr) {
    return InvalidArgumentError(
        "policy sfi: resolving its trigger strings needs the model's tokenizer "
        "(tokenizer.json), or give `triggers: []`");
  }
  RUBATO_ASSIGN_OR_RETURN(trigger_ids_, ResolveTriggerTokens(*tokenizer, config_.triggers));
  return Status::Ok();
}

Status SfiPolicy::SetTriggerIds(std::vector<int> trigger_ids) {
  if (!std::is_sorted(trigger_ids.begin(), trigger_ids.end()) ||
      std::adjacent_find(trigger_ids.begin(), trigger_ids.end()) != trigger_ids.end()) {
    return InvalidArgumentError("policy sfi: trigger ids must be sorted and unique");
  }
  trigger_ids_ = std::move(trigger_ids);
  return Status::Ok();
}

Status SfiPolicy::CheckLimits(int max_context) const {
  // Their sum sizes each layer's compact buffer (SfiCompactCapacity); bounded, it fits an int.
  const SfiPolicyConfig d;
  return CheckTokenCounts(
      {{"sink_tokens", config_.sink_tokens, d.sink_tokens},
       {"recent_window", config_.recent_window, d.recent_window},
       {"budget", config_.selector.budget, d.selector.budget},
       {"nms_window", config_.selector.nms_window, d.selector.nms_window},
       {"continuation", config_.selector.continuation, d.selector.continuation}},
      max_context);
}

Result<std::unique_ptr<AttentionBackend>> SfiPolicy::MakeBackend(Model& model,
                                                                 int max_batch) const {
  if (max_batch < 1) {
    return InvalidArgumentError("policy sfi: max_batch must be >= 1, got " +
                                std::to_string(max_batch));
  }
  for (int id : trigger_ids_) {
    if (id < 0 || id >= model.config().vocab_size) {
      return InvalidArgumentError("policy sfi: trigger token " + std::to_string(id) +
                                  " is outside the vocabulary");
    }
  }
  if (model.backend_name() == "cpu") return MakeSfiCpuBackend(model.config(), config_);
#ifdef RUBATO_HAS_CUDA
  if (model.backend_name() == "cuda") {
    return MakeSfiCudaBackend(static_cast<CudaModel&>(model), config_, max_batch);
  }
#endif
  return UnsupportedError("policy sfi: no backend half for the " +
                          std::string(model.backend_name()) + " model");
}

std::unique_ptr<PolicyRequest> SfiPolicy::Admit(KvResidency /*residency*/) {
  return std::make_unique<Request>(*this);
}

void SfiPolicy::Count(SfiStepKind step, bool discarded) {
  if (step == SfiStepKind::kSlow) {
    ++counters_.slow_steps;
    if (slow_steps_metric_ != nullptr) slow_steps_metric_->Increment();
    return;
  }
  ++counters_.fast_steps;
  // The metric counts the fast steps whose token stood; a discarded one counts as discarded and
  // its redo as slow, so slow + fast + discarded is every step run.
  if (fast_steps_metric_ != nullptr && !discarded) fast_steps_metric_->Increment();
  if (discarded) {
    ++counters_.discarded_steps;
    if (discarded_steps_metric_ != nullptr) discarded_steps_metric_->Increment();
  }
}

Status SfiPolicy::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(
      slow_steps_metric_,
      registry.AddCounter("rubato:slow_steps_total",
                          "SFI steps that attended densely and refreshed a selection."));
  RUBATO_ASSIGN_OR_RETURN(
      fast_steps_metric_,
      registry.AddCounter("rubato:fast_steps_total",
                          "SFI steps that attended their sparse working set and kept "
                          "their token (discarded ones excluded)."));
  RUBATO_ASSIGN_OR_RETURN(
      discarded_steps_metric_,
      registry.AddCounter("rubato:discarded_fast_steps_total",
                          "SFI fast steps whose token fell below the confidence threshold; "
                          "each was recomputed as a slow step."));
  if (config_.fidelity_guard > 0.0) {
    RUBATO_ASSIGN_OR_RETURN(
        guard_metric_,
        registry.AddCounter("rubato:fidelity_guard_firings_total",
                            "Steps on which the fidelity guard found the attended rows chosen "
                            "for a query that drifted (SFI: recomputed as slow steps)."));
  }
  return Status::Ok();
}

void SfiPolicy::CountGuard(bool checked, bool fired) {
  ++guard_counters_.steps;
  if (checked) ++guard_counters_.checks;
  if (!fired) return;
  ++guard_counters_.firings;
  if (guard_metric_ != nullptr) guard_metric_->Increment();
}

std::string SfiPolicy::StatsLine() const {
  std::string line = " sfi_slow_steps=" + std::to_string(counters_.slow_steps) +
                     " sfi_fast_steps=" + std::to_string(counters_.fast_steps) +
                     " sfi_discarded_steps=" + std::to_string(counters_.discarded_steps);
  if (config_.fidelity_guard > 0.0) line += FidelityGuardStats("sfi", guard_counters_);
  return line;
}

Result<std::unique_ptr<AttentionPolicy>> CreateSfiPolicy(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(const SfiPolicyConfig config, ParseSfiPolicyConfig(section));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<SfiPolicy> policy, SfiPolicy::Create(config));
  return std::unique_ptr<AttentionPolicy>(std::move(policy));
}

double SfiRetainedKvRatio(const SfiSequenceState& state, int context) {
  if (state.layers.empty() || state.layers.front().counts.empty()) return 1.0;
  int64_t kept = 0;
  int64_t heads = 0;
  for (const SfiLayerState& layer : state.layers) {
    for (int count : layer.counts) {
      kept += count;
      ++heads;
    }
  }
  const double per_head = static_cast<double>(kept) / static_cast<double>(heads);
  return (per_head + (context - state.anchor)) / context;
}

}  // namespace rubato
