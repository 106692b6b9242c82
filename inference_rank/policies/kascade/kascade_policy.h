// Kascade (the Kascade paper §3; docs/design.md §4.4): top-k selections made on a few anchor
// layers and reused by the layers after them. Decode: layer 0 dense, every anchor selects per KV
// head the top k positions of its query's GQA-pooled post-softmax probabilities and attends them,
// each reuse layer attends its anchor's selection through the calibrated head map (index gather).
// k = min(L, max(ceil(top_k_ratio L), top_k_min)); k >= L attends densely. Prefill (tiled): the
// same per tile of `prefill_tile` queries, pooled over the tile. Anchors and head map come from
// `rubato calibrate kascade`. Narrative and choices: docs/kascade.md.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "inference_rank/attention/fidelity_guard.h"
#include "inference_rank/attention/policy.h"
#include "inference_rank/policies/kascade/kascade_calibration.h"

namespace rubato {

struct KascadeConfig {
  std::string calibration;        // the calibration file (required)
  double top_k_ratio = 0.1;       // (0, 1]
  int top_k_min = 128;            // >= 1
  std::string prefill = "tiled";  // tiled (tile-sparse, §3.4) | dense
  int prefill_tile = 128;         // queries per prefill tile, >= 1
  // [0, 1]; 0 = off. The seam's fidelity guard (inference_rank/attention/fidelity_guard.h,
  // docs/fidelity.md): a reuse layer whose query heads drifted below this cosine from its query
  // at its own last selection selects its own top-k this step instead of its anchor's (CPU).
  double fidelity_guard = 0.0;
};

// One request's guard state (EntryAttention::state of Kascade's plans): each reuse layer's
// query at its own last top-k.
struct KascadeGuardState {
  QueryDriftGuard guard;
};

// Positions every anchor keeps per KV head for a context of `length` positions.
int KascadeTopK(const KascadeConfig& config, int length);
// A prefill tile [b, b + prefill_tile) selects min(b, KascadeTopK(b + prefill_tile)) of the b
// positions before it; true when that drops none for any tile the chunk meets.
bool KascadePrefillChunkIsDense(const KascadeConfig& config, int start_position, int tokens);

struct KascadeCounters {
  std::atomic<int64_t> sparse_steps{0};        // decode tokens on anchors + reuse layers
  std::atomic<int64_t> dense_steps{0};         // decode tokens with k >= L (dense)
  std::atomic<int64_t> anchor_layer_steps{0};  // (token, anchor layer) pairs, layer 0 included
  std::atomic<int64_t> reuse_layer_steps{0};   // (token, reuse layer) pairs
  // policy.fidelity_guard > 0: (token, reuse layer) pairs the guard judged and fired on (the
  // layer then attended its own top-k).
  std::atomic<int64_t> guard_checks{0};
  std::atomic<int64_t> guard_firings{0};
};

class KascadePolicy final : public AttentionPolicy {
 public:
  KascadePolicy(const KascadeConfig& config, KascadeCalibration calibration);
  std::string_view name() const override { return "kascade"; }
  const PolicyTraits& traits() const override;
  // InvalidArgument for a model the calibration was not made for (its shape); Unsupported for
  // tiled prefill on the CUDA model (its decode is built, its prefill runs dense).
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model, int max_batch) const override;
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override;
  Status RegisterMetrics(MetricsRegistry& registry) override;
  std::string StatsLine() const override;

  const KascadeConfig& config() const { return config_; }
  const KascadeCalibration& calibration() const { return calibration_; }
  // [num_layers]: layer 0 dense, anchors gather their own selection, the rest their anchor's.
  const std::vector<LayerAction>& layer_actions() const { return actions_; }
  void CountToken(bool sparse);
  // A reuse layer's guard check of one decode token (the backend's; counters are atomic).
  void CountGuard(bool fired) const;

 private:
  KascadeConfig config_;
  KascadeCalibration calibration_;
  std::vector<LayerAction> actions_;
  mutable KascadeCounters counters_;
  Counter* guard_metric_ = nullptr;   // Increment() from CountGuard (const)
  Counter* anchor_metric_ = nullptr;  // in the registry, once registered
  Counter* reuse_metric_ = nullptr;
  Counter* dense_metric_ = nullptr;
};

// `policy: {name: kascade, calibration: FILE, top_k_ratio: 0.1, top_k_min: 128, prefill: tiled,
// prefill_tile: 128}`; loads and validates the calibration file.
Result<KascadeConfig> ParseKascadeConfig(const PolicySection& section);
Result<std::unique_ptr<AttentionPolicy>> CreateKascadePolicy(const PolicySection& section);

}  // namespace rubato
