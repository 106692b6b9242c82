// Oracle top-k's host half: its config and its plans (see oracle_topk_policy.h).
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"

#include <algorithm>
#include <limits>

#include "common/yaml_map_reader.h"
#include "inference_rank/model/model.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_cpu_backend.h"

#ifdef RUBATO_HAS_CUDA
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_cuda_backend.h"
#endif

namespace rubato {
namespace {

// A request on local KV: dense prefill, then a selection of its own query every decode step.
class OracleTopKRequest final : public PolicyRequest {
 public:
  explicit OracleTopKRequest(const OracleTopKConfig& config) : config_(config) {}

  const EntryAttention* PlanPrefill(int /*start_position*/, int /*chunk_tokens*/,
                                    bool /*last_chunk*/) override {
    retained_ = -1.0;
    return nullptr;
  }
  const EntryAttention* PlanDecode(int position) override {
    const int length = position + 1;
    const OracleCandidates candidates = OracleCandidatesFor(config_, length);
    if (config_.top_k >= candidates.count()) {  // every candidate kept: dense attention
      retained_ = -1.0;
      return nullptr;
    }
    retained_ = static_cast<double>(candidates.sink_end + config_.top_k +
                                    (length - candidates.recent_begin)) /
                length;
    entry_.action.op = AttentionOp::kTwoSegment;
    entry_.action.evidence = kPooledProbs;
    entry_.action.recent_begin = candidates.recent_begin;
    entry_.row_group = kOracleTopKRows;
    return &entry_;
  }
  Verdict Observe(bool /*decode*/, int /*token*/, float /*probability*/) override {
    last_retained_ = retained_;
    return Verdict::kAccept;
  }
  double RetainedKvRatio(int /*context*/) const override {
    return last_retained_ < 0.0 ? 1.0 : last_retained_;
  }

 private:
  OracleTopKConfig config_;
  EntryAttention entry_;
  double retained_ = -1.0;       // of the planned entry; -1: dense
  double last_retained_ = -1.0;  // of the last accepted token
};

}  // namespace

OracleCandidates OracleCandidatesFor(const OracleTopKConfig& config, int length) {
  OracleCandidates candidates;
  candidates.recent_begin = std::max(0, length - config.recent_window);
  candidates.sink_end = std::min(config.sink_tokens, candidates.recent_begin);
  return candidates;
}

const PolicyTraits& OracleTopKPolicy::traits() const {
  static const PolicyTraits traits{ResidencySet{KvResidency::kLocal, KvResidency::kOffloaded},
                                   true};
  return traits;
}

Status OracleTopKPolicy::CheckLimits(int max_context) const {
  const OracleTopKConfig d;
  return CheckTokenCounts({{"top_k", config_.top_k, d.top_k},
                           {"sink_tokens", config_.sink_tokens, d.sink_tokens},
                           {"recent_window", config_.recent_window, d.recent_window}},
                          max_context);
}

Result<std::unique_ptr<AttentionBackend>> OracleTopKPolicy::MakeBackend(Model& model,
                                                                        int max_batch) const {
  if (model.backend_name() == "cpu") return MakeOracleTopKCpuBackend(model.config(), config_);
#ifdef RUBATO_HAS_CUDA
  if (model.backend_name() == "cuda") {
    return MakeOracleTopKCudaBackend(static_cast<CudaModel&>(model), config_, max_batch);
  }
#endif
  (void)max_batch;
  return UnsupportedError("policy oracle_topk: no backend half for the " +
                          std::string(model.backend_name()) + " model");
}

std::unique_ptr<PolicyRequest> OracleTopKPolicy::Admit(KvResidency residency) {
  if (residency == KvResidency::kOffloaded) return nullptr;
  return std::make_unique<OracleTopKRequest>(config_);
}

Result<OracleTopKConfig> ParseOracleTopKConfig(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  OracleTopKConfig config;
  RUBATO_RETURN_IF_ERROR(params.ReadInt("top_k", 1, kMax, &config.top_k));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("sink_tokens", 0, kMax, &config.sink_tokens));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("recent_window", 1, kMax, &config.recent_window));
  RUBATO_RETURN_IF_ERROR(params.Finish());
  return config;
}

Result<std::unique_ptr<AttentionPolicy>> CreateOracleTopKPolicy(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(const OracleTopKConfig config, ParseOracleTopKConfig(section));
  return std::unique_ptr<AttentionPolicy>(new OracleTopKPolicy(config));
}

}  // namespace rubato
