// Oracle top-k (docs/design.md §4.7; the Kascade paper's "Oracle"): every decode step and layer,
// each KV head attends the sink, the exact top-k positions of the current query and the recent
// window. The upper bound every selection policy is judged against. docs/oracle_topk.md.
//
// Selection, per (layer, KV head), for the query at position L - 1: candidates J = [sink_end,
// recent_begin) with recent_begin = max(0, L - recent_window), sink_end = min(sink_tokens,
// recent_begin); each query head's softmax over J (scale * q.k), averaged over the GQA group;
// the top_k best (ties to the lower position). Prefill is dense. When top_k >= |J| the plan is
// dense: keeping every candidate attends every position.
#pragma once

#include <memory>
#include <string>

#include "common/config.h"
#include "inference_rank/attention/policy.h"

namespace rubato {

// The row group of its two-segment entries (EntryAttention::row_group).
inline constexpr int kOracleTopKRows = 1;

struct OracleTopKConfig {
  int top_k = 2048;         // >= 1: selected positions per layer and KV head
  int sink_tokens = 4;      // >= 0: leading positions always attended
  int recent_window = 256;  // >= 1: trailing positions always attended (the query's included)
};

// The candidate set of the query at position length - 1 (see the file comment).
struct OracleCandidates {
  int sink_end = 0;
  int recent_begin = 0;
  int count() const { return recent_begin - sink_end; }
};
OracleCandidates OracleCandidatesFor(const OracleTopKConfig& config, int length);

class OracleTopKPolicy final : public AttentionPolicy {
 public:
  explicit OracleTopKPolicy(const OracleTopKConfig& config) : config_(config) {}
  std::string_view name() const override { return "oracle_topk"; }
  const PolicyTraits& traits() const override;
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model, int max_batch) const override;
  Status CheckLimits(int max_context) const override;
  // Offloaded KV: no local plan (the cache rank's oracle_topk selector chooses the rows).
  // The cache rank's oracle_topk selector with this config.
  Result<CacheSelectorSpec> MakeCacheSelector() const override {
    return CacheSelectorSpec{"oracle_topk", config_.top_k, config_.sink_tokens,
                             config_.recent_window};
  }
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override;
  const OracleTopKConfig& config() const { return config_; }

 private:
  OracleTopKConfig config_;
};

// `policy: {name: oracle_topk, top_k: 2048, sink_tokens: 4, recent_window: 256}`.
Result<OracleTopKConfig> ParseOracleTopKConfig(const PolicySection& section);
Result<std::unique_ptr<AttentionPolicy>> CreateOracleTopKPolicy(const PolicySection& section);

}  // namespace rubato
