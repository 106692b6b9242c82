// Kascade's host half: config, calibration, per-layer plan, counters (see kascade_policy.h).
#include "inference_rank/policies/kascade/kascade_policy.h"

#include <cmath>
#include <limits>

#include "common/logging.h"
#include "common/yaml_map_reader.h"
#include "inference_rank/model/model.h"
#include "inference_rank/policies/kascade/kascade_cpu_backend.h"

#ifdef RUBATO_HAS_CUDA
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/kascade/kascade_cuda_backend.h"
#endif

namespace rubato {
namespace {

// Dense prefill, then every decode token on the per-layer plan (dense while k >= L).
class KascadeRequest final : public PolicyRequest {
 public:
  explicit KascadeRequest(KascadePolicy& policy) : policy_(policy) {
    entry_.layer_actions = policy.layer_actions().data();
    entry_.action = policy.layer_actions().front();
    entry_.row_group = 1;
    if (policy.config().fidelity_guard > 0.0) entry_.state = &guard_;
  }

  const EntryAttention* PlanPrefill(int start_position, int chunk_tokens,
                                    bool /*last_chunk*/) override {
    planned_ = -1.0;
    const KascadeConfig& config = policy_.config();
    if (config.prefill == "dense" ||
        KascadePrefillChunkIsDense(config, start_position, chunk_tokens)) {
      return nullptr;
    }
    return &entry_;
  }
  const EntryAttention* PlanDecode(int position) override {
    const int length = position + 1;
    const int k = KascadeTopK(policy_.config(), length);
    if (k >= length) {
      planned_ = -1.0;
      return nullptr;
    }
    const int layers = static_cast<int>(policy_.layer_actions().size());
    planned_ = (1.0 + (layers - 1) * static_cast<double>(k) / length) / layers;
    return &entry_;
  }
  Verdict Observe(bool decode, int /*token*/, float /*probability*/) override {
    if (decode) policy_.CountToken(planned_ >= 0.0);
    last_ = planned_;
    return Verdict::kAccept;
  }
  double RetainedKvRatio(int /*context*/) const override { return last_ < 0.0 ? 1.0 : last_; }

 private:
  KascadePolicy& policy_;
  EntryAttention entry_;
  double planned_ = -1.0;  // retained share of the planned entry; -1: dense
  double last_ = -1.0;     // of the last accepted token
  KascadeGuardState guard_;
};

}  // namespace

int KascadeTopK(const KascadeConfig& config, int length) {
  const double wanted = std::ceil(config.top_k_ratio * length);
  const int k = wanted >= length ? length : static_cast<int>(wanted);
  return std::min(length, std::max(k, config.top_k_min));
}

bool KascadePrefillChunkIsDense(const KascadeConfig& config, int start_position, int tokens) {
  const int tile = config.prefill_tile;
  const int end = start_position + tokens;
  for (int begin = start_position / tile * tile; begin < end; begin += tile) {
    if (KascadeTopK(config, begin + tile) < begin) return false;
  }
  return true;
}

KascadePolicy::KascadePolicy(const KascadeConfig& config, KascadeCalibration calibration)
    : config_(config), calibration_(std::move(calibration)) {
  actions_.resize(static_cast<size_t>(calibration_.num_layers));
  for (int layer = 0; layer < calibration_.num_layers; ++layer) {
    LayerAction& action = actions_[static_cast<size_t>(layer)];
    const bool anchor = calibration_.IsAnchor(layer);
    action.op = layer == 0 ? AttentionOp::kDense : AttentionOp::kIndexGather;
    action.evidence = anchor ? kPooledProbs : kNoEvidence;
    action.source_layer = calibration_.AnchorOf(layer);
  }
}

const PolicyTraits& KascadePolicy::traits() const {
  static const PolicyTraits traits{ResidencySet{KvResidency::kLocal}, true};
  return traits;
}

Result<std::unique_ptr<AttentionBackend>> KascadePolicy::MakeBackend(Model& model,
                                                                     int /*max_batch*/) const {
  const ModelConfig& shape = model.config();
  RUBATO_RETURN_IF_ERROR(
      CheckCalibrationFits(calibration_, shape.num_layers, shape.num_heads, shape.num_kv_heads,
                           shape.head_dim)
          .WithContext("policy kascade, calibration '" + config_.calibration + "'"));
  if (model.backend_name() == "cpu") return MakeKascadeCpuBackend(shape, *this);
#ifdef RUBATO_HAS_CUDA
  if (model.backend_name() == "cuda") {
    if (config_.fidelity_guard > 0.0) {
      return UnsupportedError(
          "policy kascade: policy.fidelity_guard is built on the CPU model only (engine.backend: "
          "cpu runs it)");
    }
    return MakeKascadeCudaBackend(static_cast<CudaModel&>(model), *this);
  }
#endif
  return UnsupportedError("policy kascade: no backend half for the " +
                          std::string(model.backend_name()) +
                          " model yet (engine.backend: cpu runs it)");
}

std::unique_ptr<PolicyRequest> KascadePolicy::Admit(KvResidency /*residency*/) {
  return std::make_unique<KascadeRequest>(*this);
}

void KascadePolicy::CountToken(bool sparse) {
  if (!sparse) {
    ++counters_.dense_steps;
    if (dense_metric_ != nullptr) dense_metric_->Increment();
    return;
  }
  ++counters_.sparse_steps;
  const int anchors = static_cast<int>(calibration_.anchors.size());
  const int reuse = calibration_.num_layers - anchors;
  counters_.anchor_layer_steps += anchors;
  counters_.reuse_layer_steps += reuse;
  if (anchor_metric_ != nullptr) anchor_metric_->Increment(anchors);
  if (reuse_metric_ != nullptr) reuse_metric_->Increment(reuse);
}

Status KascadePolicy::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(
      anchor_metric_,
      registry.AddCounter("rubato:kascade_anchor_layer_steps_total",
                          "Kascade (decode token, anchor layer) pairs: attention that selected "
                          "a top-k (layer 0 included)."));
  RUBATO_ASSIGN_OR_RETURN(
      reuse_metric_,
      registry.AddCounter("rubato:kascade_reuse_layer_steps_total",
                          "Kascade (decode token, reuse layer) pairs: attention over an anchor's "
                          "selection."));
  RUBATO_ASSIGN_OR_RETURN(
      dense_metric_,
      registry.AddCounter("rubato:kascade_dense_steps_total",
                          "Kascade decode tokens attended densely (top-k covered the context)."));
  if (config_.fidelity_guard > 0.0) {
    RUBATO_ASSIGN_OR_RETURN(
        guard_metric_,
        registry.AddCounter("rubato:fidelity_guard_firings_total",
                            "Steps on which the fidelity guard found the attended rows chosen "
                            "for a query that drifted (Kascade: (token, reuse layer) pairs that "
                            "selected their own top-k)."));
  }
  return Status::Ok();
}

void KascadePolicy::CountGuard(bool fired) const {
  ++counters_.guard_checks;
  if (!fired) return;
  ++counters_.guard_firings;
  if (guard_metric_ != nullptr) guard_metric_->Increment();
}

std::string KascadePolicy::StatsLine() const {
  std::string line =
      " kascade_sparse_steps=" + std::to_string(counters_.sparse_steps.load()) +
      " kascade_dense_steps=" + std::to_string(counters_.dense_steps.load()) +
      " kascade_anchor_layer_steps=" + std::to_string(counters_.anchor_layer_steps.load()) +
      " kascade_reuse_layer_steps=" + std::to_string(counters_.reuse_layer_steps.load());
  if (config_.fidelity_guard > 0.0) {
    FidelityGuardCounters guard;
    guard.checks = counters_.guard_checks.load();
    guard.firings = counters_.guard_firings.load();
    guard.steps = counters_.sparse_steps.load();  // firings are per (token, reuse layer)
    line += FidelityGuardStats("kascade", guard);
  }
  return line;
}

Result<KascadeConfig> ParseKascadeConfig(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  KascadeConfig config;
  RUBATO_RETURN_IF_ERROR(params.ReadString("calibration", &config.calibration));
  DoubleRange ratio;
  ratio.min = 0.0;
  ratio.min_inclusive = false;
  ratio.max = 1.0;
  RUBATO_RETURN_IF_ERROR(params.ReadDouble("top_k_ratio", ratio, &config.top_k_ratio));
  RUBATO_RETURN_IF_ERROR(
      params.ReadInt("top_k_min", 1, std::numeric_limits<int>::max(), &config.top_k_min));
  RUBATO_RETURN_IF_ERROR(params.ReadString("prefill", &config.prefill));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("prefill_tile", 1, 1 << 20, &config.prefill_tile));
  RUBATO_RETURN_IF_ERROR(ReadFidelityGuard(params, &config.fidelity_guard));
  RUBATO_RETURN_IF_ERROR(params.Finish());
  if (config.calibration.empty()) {
    return InvalidArgumentError(
        "policy kascade: 'calibration' names the file of `rubato calibrate kascade` (required)");
  }
  if (config.prefill != "dense" && config.prefill != "tiled") {
    return InvalidArgumentError("policy kascade: prefill '" + config.prefill +
                                "' is not one of tiled, dense");
  }
  return config;
}

Result<std::unique_ptr<AttentionPolicy>> CreateKascadePolicy(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(const KascadeConfig config, ParseKascadeConfig(section));
  RUBATO_ASSIGN_OR_RETURN(KascadeCalibration calibration, LoadCalibration(config.calibration));
  if (!calibration.known_loss.empty()) {
    RUBATO_LOG_WARN("kascade", "calibration {}: {}", config.calibration, calibration.known_loss);
  }
  return std::unique_ptr<AttentionPolicy>(new KascadePolicy(config, std::move(calibration)));
}

}  // namespace rubato
