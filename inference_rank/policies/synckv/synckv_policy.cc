// SyncKV's host half: config, head split, per-request plan, counters (see synckv_policy.h).
#include "inference_rank/policies/synckv/synckv_policy.h"

#include <algorithm>
#include <cmath>

#include "common/yaml_map_reader.h"
#include "inference_rank/model/model.h"
#include "inference_rank/policies/synckv/synckv_cpu_backend.h"
#ifdef RUBATO_HAS_CUDA
#include "inference_rank/policies/synckv/synckv_cuda_backend.h"
#endif

namespace rubato {
namespace {

// Dense prefill; the prompt's last chunk selects the initial sets; then every decode step is an
// anticipation (every stride-th) or a suspension. All of it on the split_by_head residency.
class SyncKvRequest final : public PolicyRequest {
 public:
  explicit SyncKvRequest(SyncKvPolicy& policy) : policy_(policy) {
    entry_.action.op = AttentionOp::kDense;  // the residency writes the decode rows
    entry_.row_group = 1;
    entry_.state = &step_;
  }

  const EntryAttention* PlanPrefill(int start_position, int chunk_tokens,
                                    bool last_chunk) override {
    planned_decode_ = false;
    if (!last_chunk) return nullptr;
    prompt_tokens_ = start_position + chunk_tokens;
    step_.kind = SyncKvStep::Kind::kPromptEnd;
    return &entry_;
  }
  const EntryAttention* PlanDecode(int position) override {
    // Algorithm 1: decode step t = 1, 2, ...; anticipation when t mod m = 0.
    const int t = position - prompt_tokens_ + 1;
    step_.kind = t % policy_.config().stride == 0 ? SyncKvStep::Kind::kAnticipation
                                                  : SyncKvStep::Kind::kSuspension;
    planned_decode_ = true;
    planned_context_ = position + 1;
    return &entry_;
  }
  Verdict Observe(bool decode, int /*token*/, float /*probability*/) override {
    if (decode && planned_decode_) {
      policy_.CountStep(step_.kind == SyncKvStep::Kind::kAnticipation);
      last_context_ = planned_context_;
    }
    return Verdict::kAccept;
  }
  double RetainedKvRatio(int /*context*/) const override {
    return last_context_ > 0 ? policy_.RetainedShare(last_context_) : 1.0;
  }

 private:
  SyncKvPolicy& policy_;
  EntryAttention entry_;
  SyncKvStep step_;
  int prompt_tokens_ = 0;
  bool planned_decode_ = false;
  int planned_context_ = 0;
  int last_context_ = 0;  // of the last accepted decode token; 0: none yet (dense prefill)
};

HeadSplit SplitOf(const SyncKvCalibration& c) {
  HeadSplit split;
  split.num_layers = c.num_layers;
  split.num_kv_heads = c.num_kv_heads;
  for (const HeadClusters& layer : c.layers) {
    split.cluster.push_back(layer.cluster);
    split.representative.push_back(layer.representative);
  }
  return split;
}

}  // namespace

SyncKvPolicy::SyncKvPolicy(const SyncKvConfig& config, SyncKvCalibration calibration,
                           HeadSplit split)
    : config_(config), calibration_(std::move(calibration)), split_(std::move(split)) {}

Result<std::unique_ptr<SyncKvPolicy>> SyncKvPolicy::Create(const SyncKvConfig& config,
                                                           SyncKvCalibration calibration) {
  if (config.representatives < 1 || config.representatives > calibration.num_kv_heads) {
    return InvalidArgumentError(
        "policy.representatives: " + std::to_string(config.representatives) + " must lie in [1, " +
        std::to_string(calibration.num_kv_heads) + "] (the calibrated model's KV heads per layer)");
  }
  // The file records S; the clusters are recomputed for this N_r (the same function).
  RUBATO_RETURN_IF_ERROR(ClusterCalibration(calibration, config.representatives));
  HeadSplit split = SplitOf(calibration);
  return std::unique_ptr<SyncKvPolicy>(
      new SyncKvPolicy(config, std::move(calibration), std::move(split)));
}

const PolicyTraits& SyncKvPolicy::traits() const {
  // Not graph-replayable: its CUDA steps plan on the host which rows select and where the
  // rows of each selection come from, and the residency's steps run eagerly.
  static const PolicyTraits traits{ResidencySet{KvResidency::kSplitByHead}, false};
  return traits;
}

int SyncKvPolicy::Budget(int context) const {
  const double mem = config_.mem_percent / 100.0;
  double share = mem;
  if (config_.mem_basis == "total") {
    const double heads = calibration_.num_kv_heads, r = config_.representatives;
    share = heads > r ? (mem * heads - r) / (heads - r) : 1.0;
  }
  const double wanted = std::ceil(std::max(0.0, share) * context - 1e-9);
  return static_cast<int>(std::clamp(wanted, 1.0, static_cast<double>(context)));
}

double SyncKvPolicy::RetainedShare(int context) const {
  const double heads = calibration_.num_kv_heads, r = config_.representatives;
  return (r + (heads - r) * static_cast<double>(Budget(context)) / context) / heads;
}

Result<std::unique_ptr<AttentionBackend>> SyncKvPolicy::MakeBackend(Model& model,
                                                                    int /*max_batch*/) const {
  const ModelConfig& shape = model.config();
  RUBATO_RETURN_IF_ERROR(
      CheckSyncKvCalibrationFits(calibration_, shape.num_layers, shape.num_heads,
                                 shape.num_kv_heads, shape.head_dim)
          .WithContext("policy synckv, calibration '" + config_.calibration + "'"));
  if (config_.mem_basis == "total" &&
      config_.mem_percent / 100.0 * calibration_.num_kv_heads <= config_.representatives) {
    return InvalidArgumentError(
        "policy.mem_percent: " + std::to_string(config_.mem_percent) +
        " % with mem_basis total is at or below the R-heads' own share of the KV (" +
        std::to_string(config_.representatives) + " of " +
        std::to_string(calibration_.num_kv_heads) +
        " KV heads per layer); raise it or use mem_basis nr_heads");
  }
  if (model.backend_name() == "cpu") return MakeSyncKvCpuBackend(shape, *this);
#ifdef RUBATO_HAS_CUDA
  if (model.backend_name() == "cuda") {
    return MakeSyncKvCudaBackend(static_cast<CudaModel&>(model), *this);
  }
#endif
  return UnsupportedError("policy synckv: no backend half for the " +
                          std::string(model.backend_name()) + " model");
}

HeadSplitStore SyncKvPolicy::store() const {
  HeadSplitStore store;
  store.where = config_.store;
  store.device = config_.store_device;
  store.fetch_delay_ns = static_cast<unsigned int>(config_.fetch_delay_us) * 1000u;
  return store;
}

std::unique_ptr<PolicyRequest> SyncKvPolicy::Admit(KvResidency /*residency*/) {
  return std::make_unique<SyncKvRequest>(*this);
}

void SyncKvPolicy::CountStep(bool anticipation) {
  ++(anticipation ? counters_.anticipation_steps : counters_.suspension_steps);
  Counter* metric = anticipation ? anticipation_metric_ : suspension_metric_;
  if (metric != nullptr) metric->Increment();
}

Status SyncKvPolicy::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(
      anticipation_metric_,
      registry.AddCounter("rubato:synckv_anticipation_steps_total",
                          "SyncKV decode steps whose R-heads chose the next dynamic set."));
  RUBATO_ASSIGN_OR_RETURN(suspension_metric_,
                          registry.AddCounter("rubato:synckv_suspension_steps_total",
                                              "SyncKV decode steps reusing the sparse sets."));
  return Status::Ok();
}

std::string SyncKvPolicy::StatsLine() const {
  return " synckv_anticipation_steps=" + std::to_string(counters_.anticipation_steps) +
         " synckv_suspension_steps=" + std::to_string(counters_.suspension_steps);
}

Result<SyncKvConfig> ParseSyncKvConfig(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  SyncKvConfig config;
  RUBATO_RETURN_IF_ERROR(params.ReadString("calibration", &config.calibration));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("representatives", 1, 1 << 10, &config.representatives));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("stride", 1, 1 << 20, &config.stride));
  DoubleRange ratio;
  ratio.min = 0.0;
  ratio.max = 1.0;
  RUBATO_RETURN_IF_ERROR(params.ReadDouble("static_ratio", ratio, &config.static_ratio));
  DoubleRange percent;
  percent.min = 0.0;
  percent.min_inclusive = false;
  percent.max = 100.0;
  RUBATO_RETURN_IF_ERROR(params.ReadDouble("mem_percent", percent, &config.mem_percent));
  RUBATO_RETURN_IF_ERROR(params.ReadString("mem_basis", &config.mem_basis));
  RUBATO_RETURN_IF_ERROR(params.ReadString("store", &config.store));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("store_device", 0, 1023, &config.store_device));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("fetch_delay_us", 0, 1000000, &config.fetch_delay_us));
  RUBATO_RETURN_IF_ERROR(params.Finish());
  if (config.calibration.empty()) {
    return InvalidArgumentError(
        "policy synckv: 'calibration' names the file of `rubato calibrate synckv` (required)");
  }
  if (config.mem_basis != "nr_heads" && config.mem_basis != "total") {
    return InvalidArgumentError("policy.mem_basis: '" + config.mem_basis +
                                "' is not one of nr_heads, total");
  }
  if (config.store != "host" && config.store != "device") {
    return InvalidArgumentError("policy.store: '" + config.store + "' is not one of host, device");
  }
  return config;
}

Result<std::unique_ptr<AttentionPolicy>> CreateSyncKvPolicy(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(const SyncKvConfig config, ParseSyncKvConfig(section));
  RUBATO_ASSIGN_OR_RETURN(SyncKvCalibration calibration, LoadSyncKvCalibration(config.calibration));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<SyncKvPolicy> policy,
                          SyncKvPolicy::Create(config, std::move(calibration)));
  return std::unique_ptr<AttentionPolicy>(std::move(policy));
}

}  // namespace rubato
