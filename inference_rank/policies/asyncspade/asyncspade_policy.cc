// AsyncSpade's host half: its config, its traits and the cache-rank selector it names (see
// asyncspade_policy.h).
#include "inference_rank/policies/asyncspade/asyncspade_policy.h"

#include <algorithm>
#include <limits>

#include "common/yaml_map_reader.h"

namespace rubato {

const PolicyTraits& AsyncSpadePolicy::traits() const {
  // Offloaded KV only; the CPU half syncs per layer and the CUDA half goes through host memory,
  // so its steps are not replayed as graphs (docs/residency.md).
  static const PolicyTraits traits{ResidencySet{KvResidency::kOffloaded}, false};
  return traits;
}

Result<std::unique_ptr<AttentionBackend>> AsyncSpadePolicy::MakeBackend(Model& /*model*/,
                                                                        int /*max_batch*/) const {
  return std::unique_ptr<AttentionBackend>();
}

Status AsyncSpadePolicy::CheckLimits(int max_context) const {
  const AsyncSpadeConfig d;
  return CheckTokenCounts({{"top_k", config_.top_k, d.top_k},
                           {"sink_tokens", config_.sink_tokens, d.sink_tokens},
                           {"recent_window", config_.recent_window, d.recent_window}},
                          max_context);
}

Result<CacheSelectorSpec> AsyncSpadePolicy::MakeCacheSelector() const {
  CacheSelectorSpec spec;
  spec.name = "asyncspade";
  spec.top_k = config_.top_k;
  spec.sink_tokens = config_.sink_tokens;
  spec.recent_tokens = config_.recent_window;
  spec.query_window = config_.query_window;
  spec.ridge_lambda = config_.ridge_lambda;
  spec.dense_steps = config_.dense_steps;
  spec.pack_layers = config_.pack_layers;
  spec.overlap_every = config_.overlap_every;
  return spec;
}

namespace {

// A request's host half: the selection lives on the cache rank, so it plans nothing (the
// residency attends) and only counts decode steps for the share the engine reports
// (retained_kv_ratio): the first dense_steps after a prompt as the whole context (the CPU half
// attends densely there; a GPU cache rank selects the real query's top C, reported as dense all
// the same), later ones sink + C + recent of it.
class AsyncSpadeRequest final : public PolicyRequest {
 public:
  explicit AsyncSpadeRequest(const AsyncSpadeConfig& config) : config_(config) {}
  const EntryAttention* PlanPrefill(int /*start_position*/, int /*chunk_tokens*/,
                                    bool /*last_chunk*/) override {
    return nullptr;
  }
  const EntryAttention* PlanDecode(int /*position*/) override { return nullptr; }
  Verdict Observe(bool decode, int /*token*/, float /*probability*/) override {
    decode_steps_ = decode ? decode_steps_ + 1 : 0;  // the prompt's last chunk starts over
    return Verdict::kAccept;
  }
  double RetainedKvRatio(int context) const override {
    if (decode_steps_ <= config_.dense_steps || context <= 0) return 1.0;
    const double kept =
        static_cast<double>(config_.sink_tokens) + config_.top_k + config_.recent_window;
    return std::min(1.0, kept / context);
  }

 private:
  const AsyncSpadeConfig config_;
  int decode_steps_ = 0;  // accepted since the prompt's last chunk
};

}  // namespace

std::unique_ptr<PolicyRequest> AsyncSpadePolicy::Admit(KvResidency /*residency*/) {
  return std::make_unique<AsyncSpadeRequest>(config_);
}

Result<AsyncSpadeConfig> ParseAsyncSpadeConfig(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  AsyncSpadeConfig config;
  RUBATO_RETURN_IF_ERROR(params.ReadInt("top_k", 1, kMax, &config.top_k));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("sink_tokens", 0, kMax, &config.sink_tokens));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("recent_window", 1, kMax, &config.recent_window));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("query_window", 1, 64, &config.query_window));
  RUBATO_RETURN_IF_ERROR(
      params.ReadDouble("ridge_lambda", DoubleRange{0.0, 1e6, false, true}, &config.ridge_lambda));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("dense_steps", 0, kMax, &config.dense_steps));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("pack_layers", 0, 1024, &config.pack_layers));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("overlap_every", 0, kMax, &config.overlap_every));
  RUBATO_RETURN_IF_ERROR(params.Finish());
  return config;
}

Result<std::unique_ptr<AttentionPolicy>> CreateAsyncSpadePolicy(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(const AsyncSpadeConfig config, ParseAsyncSpadeConfig(section));
  return std::unique_ptr<AttentionPolicy>(new AsyncSpadePolicy(config));
}

}  // namespace rubato
