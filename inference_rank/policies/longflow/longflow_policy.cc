// LongFlow's host half: its config, its plans and its counters (see longflow_policy.h).
#include "inference_rank/policies/longflow/longflow_policy.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "common/yaml_map_reader.h"
#include "inference_rank/model/model.h"
#include "inference_rank/policies/longflow/longflow_cpu_backend.h"

#ifdef RUBATO_HAS_CUDA
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/longflow/longflow_cuda_backend.h"
#endif

namespace rubato {
namespace {

// Prefill attends densely through the paged cache (the last chunk's plan tells the backend to
// move the prompt into the slots); every decode token attends its slots with a fixed budget.
class LongFlowRequest final : public PolicyRequest {
 public:
  explicit LongFlowRequest(LongFlowPolicy& policy) : policy_(policy) {
    entry_.state = &state_;
    policy_.CountAdmitted();
  }
  ~LongFlowRequest() override { policy_.CountEnded(reported_); }

  const EntryAttention* PlanPrefill(int start_position, int chunk_tokens,
                                    bool last_chunk) override {
    state_.prompt_end = last_chunk ? start_position + chunk_tokens : -1;
    entry_.action = LayerAction{};  // dense
    entry_.row_group = kLongFlowPromptRows;
    return &entry_;
  }
  const EntryAttention* PlanDecode(int /*position*/) override {
    state_.prompt_end = -1;
    entry_.action.op = AttentionOp::kFixedBudget;
    entry_.action.evidence = kSlotScores;
    entry_.row_group = kLongFlowRows;
    return &entry_;
  }
  Verdict Observe(bool /*decode*/, int /*token*/, float /*probability*/) override {
    const int occupied = state_.occupied.empty() ? 0 : state_.occupied.front();
    policy_.CountToken(state_, occupied, reported_);
    reported_ = occupied;
    return Verdict::kAccept;
  }
  // The slots hold every position the query attended (at most B of them).
  double RetainedKvRatio(int context) const override {
    if (context <= 0 || reported_ <= 0) return 1.0;
    return std::min(1.0, static_cast<double>(reported_) / context);
  }

 private:
  LongFlowPolicy& policy_;
  LongFlowRequestState state_;
  EntryAttention entry_;
  int reported_ = 0;  // valid slots at the last accepted token
};

}  // namespace

LongFlowPolicy::LongFlowPolicy(const LongFlowConfig& config) : config_(config) {
  traits_.residencies = ResidencySet{KvResidency::kEvicting};
  // A decode step's shape never changes (CUDA: the next slot stays on the device).
  traits_.graph_replayable = true;
  traits_.evicting_slots = config.budget;
}

Status LongFlowPolicy::CheckLimits(int max_context) const {
  // The budget's slots are allocated per request that may run (evicting_residency.cc).
  const LongFlowConfig defaults;
  return CheckTokenCounts({{"budget", config_.budget, defaults.budget},
                           {"sink_tokens", config_.sink_tokens, defaults.sink_tokens},
                           {"snapkv_window", config_.snapkv_window, defaults.snapkv_window}},
                          max_context);
}

Result<std::unique_ptr<AttentionBackend>> LongFlowPolicy::MakeBackend(Model& model,
                                                                      int /*max_batch*/) const {
  if (model.backend_name() == "cpu") return MakeLongFlowCpuBackend(model.config(), config_);
#ifdef RUBATO_HAS_CUDA
  if (model.backend_name() == "cuda") {
    return MakeLongFlowCudaBackend(static_cast<CudaModel&>(model), config_);
  }
#endif
  return UnsupportedError("policy longflow: no backend half for the " +
                          std::string(model.backend_name()) + " model yet");
}

std::unique_ptr<PolicyRequest> LongFlowPolicy::Admit(KvResidency /*residency*/) {
  return std::make_unique<LongFlowRequest>(*this);
}

void LongFlowPolicy::CountToken(LongFlowRequestState& state, int occupied, int previous) {
  counters_.evictions += state.evictions;
  counters_.prompt_evictions += state.prompt_evictions;
  if (evictions_metric_ != nullptr && state.evictions > 0) {
    evictions_metric_->Increment(static_cast<double>(state.evictions));
  }
  if (prompt_evictions_metric_ != nullptr && state.prompt_evictions > 0) {
    prompt_evictions_metric_->Increment(static_cast<double>(state.prompt_evictions));
  }
  state.evictions = 0;
  state.prompt_evictions = 0;
  counters_.occupied_slots += occupied - previous;
  UpdateOccupancy();
}

void LongFlowPolicy::CountAdmitted() {
  ++counters_.live_requests;
  UpdateOccupancy();
}

void LongFlowPolicy::CountEnded(int occupied) {
  counters_.occupied_slots -= occupied;
  --counters_.live_requests;
  if (counters_.live_requests > 0) UpdateOccupancy();  // else: keep the last value for the stats
}

void LongFlowPolicy::UpdateOccupancy() {
  if (counters_.live_requests <= 0) return;
  counters_.last_occupancy = static_cast<double>(counters_.occupied_slots) /
                             (static_cast<double>(config_.budget) * counters_.live_requests);
  if (occupancy_metric_ != nullptr) occupancy_metric_->Set(counters_.last_occupancy);
}

Status LongFlowPolicy::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(
      evictions_metric_,
      registry.AddCounter("rubato:longflow_evictions_total",
                          "LongFlow slots overwritten by decode tokens, per layer and KV head."));
  RUBATO_ASSIGN_OR_RETURN(
      prompt_evictions_metric_,
      registry.AddCounter("rubato:longflow_prompt_evictions_total",
                          "Prompt positions LongFlow's compression did not keep, per layer and "
                          "KV head."));
  RUBATO_ASSIGN_OR_RETURN(
      occupancy_metric_,
      registry.AddGauge("rubato:longflow_budget_occupancy",
                        "Valid LongFlow slots over the budget of the running requests."));
  return Status::Ok();
}

std::string LongFlowPolicy::StatsLine() const {
  char occupancy[32];
  std::snprintf(occupancy, sizeof(occupancy), "%.3f", counters_.last_occupancy);
  return " longflow_evictions=" + std::to_string(counters_.evictions) +
         " longflow_prompt_evictions=" + std::to_string(counters_.prompt_evictions) +
         " longflow_budget_occupancy=" + occupancy;
}

Result<LongFlowConfig> ParseLongFlowConfig(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  LongFlowConfig config;
  RUBATO_RETURN_IF_ERROR(params.ReadInt("budget", 1, kMax, &config.budget));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("sink_tokens", 0, kMax, &config.sink_tokens));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("snapkv_window", 1, kMax, &config.snapkv_window));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("snapkv_pool_kernel", 1, kMax, &config.snapkv_pool_kernel));
  if (config.snapkv_pool_kernel % 2 == 0) {
    return params.Error("snapkv_pool_kernel",
                        "must be odd (a window centred on each position), got " +
                            std::to_string(config.snapkv_pool_kernel));
  }
  // The compressed prompt keeps the sinks, the window and at least one scored position, and a
  // full budget always has a slot that may be evicted.
  if (static_cast<int64_t>(config.budget) <=
      static_cast<int64_t>(config.sink_tokens) + config.snapkv_window) {
    return params.Error("budget", "must exceed sink_tokens + snapkv_window (" +
                                      std::to_string(config.sink_tokens) + " + " +
                                      std::to_string(config.snapkv_window) + "), got " +
                                      std::to_string(config.budget));
  }
  RUBATO_RETURN_IF_ERROR(params.Finish());
  return config;
}

Result<std::unique_ptr<AttentionPolicy>> CreateLongFlowPolicy(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(const LongFlowConfig config, ParseLongFlowConfig(section));
  return std::unique_ptr<AttentionPolicy>(new LongFlowPolicy(config));
}

}  // namespace rubato
