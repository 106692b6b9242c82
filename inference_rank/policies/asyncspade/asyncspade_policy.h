// AsyncSpade (docs/asyncspade.md; AsyncSpade §4): the cache rank predicts each layer's next query
// from a window of the last W queries (the assembled softmax-normalised ridge regression), selects
// the top C positions per KV head with it and replies while the inference rank computes, so the
// selection for step t + 1 is made from step t's queries and leaves the critical path. The first
// theta decode steps after a prompt attend densely; every step attends the sink, the predicted
// selection and the recent window. Only on offloaded KV (the selection lives on a cache rank):
// its host half is this config and the cache-rank selector it names (cache_rank/selectors/
// asyncspade_selector.h); the offloaded residency's model halves attend the rows that arrive.
#pragma once

#include <memory>

#include "common/config.h"
#include "inference_rank/attention/policy.h"

namespace rubato {

// The paper's values where it gives them (C = 2048 selected tokens, W = 16 queries), ours where it
// does not (docs/asyncspade.md "Our choices").
struct AsyncSpadeConfig {
  int top_k = 2048;            // C: positions selected per layer and KV head, >= 1
  int sink_tokens = 4;         // leading positions always attended, >= 0
  int recent_window = 256;     // trailing positions always attended (read locally), >= 1
  int query_window = 16;       // W: past queries the next one is regressed from, [1, 64]
  double ridge_lambda = 1e-2;  // the ridge term relative to the window's mean squared norm, > 0
  int dense_steps = 16;        // theta: decode steps after a prompt that attend densely, >= 0
  // Layers per layer pack (the paper's 6 or 12 at Qwen3-8B); 0: topology.pack_layers.
  int pack_layers = 0;
  int overlap_every = 16;  // every how many steps the selection is checked against the exact one
};

class AsyncSpadePolicy final : public AttentionPolicy {
 public:
  explicit AsyncSpadePolicy(const AsyncSpadeConfig& config) : config_(config) {}
  std::string_view name() const override { return "asyncspade"; }
  const PolicyTraits& traits() const override;
  // None: the offloaded residency attends what the cache rank replies.
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model, int max_batch) const override;
  Status CheckLimits(int max_context) const override;
  // The cache rank's `asyncspade` selector with this config.
  Result<CacheSelectorSpec> MakeCacheSelector() const override;
  // No local plan: the offloaded residency's halves attend the replies (null).
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override;
  const AsyncSpadeConfig& config() const { return config_; }

 private:
  AsyncSpadeConfig config_;
};

// `policy: {name: asyncspade, top_k: 2048, sink_tokens: 4, recent_window: 256, query_window: 16,
// ridge_lambda: 0.01, dense_steps: 16, pack_layers: 0, overlap_every: 16}`; a bad value or an
// unknown key is refused naming its key path.
Result<AsyncSpadeConfig> ParseAsyncSpadeConfig(const PolicySection& section);
Result<std::unique_ptr<AttentionPolicy>> CreateAsyncSpadePolicy(const PolicySection& section);

}  // namespace rubato
