// The fidelity guard (docs/fidelity.md): a cheap per-step signal that the rows a policy attends
// were chosen for a query that no longer asks for them, shared by every policy that supports it.
// The signal is the drift of the query since the query that made the current selection: the
// cosine between the two, RoPE taken out, averaged over the query heads of a layer. Where the
// policy judges it (SFI: the mean over all layers, once per step; Kascade: per reuse layer) and
// what a firing does (SFI: the step is recomputed as a slow step; Kascade: the reuse layer
// selects its own top-k) is the policy's. `policy.fidelity_guard` is the threshold (0 = off;
// 1 = fire on every check).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/yaml_map_reader.h"

namespace rubato {

// `policy.fidelity_guard`: the cosine below which the guard fires, in [0, 1]; 0 turns the guard
// off, 1 makes it fire on every check.
inline constexpr const char* kFidelityGuardKey = "fidelity_guard";

// Reads `policy.fidelity_guard` (absent: 0, off) from a policy section's reader; errors name the
// key ("policy.fidelity_guard: must be in [0, 1], got 1.5").
Status ReadFidelityGuard(YamlMapReader& params, double* min_cosine);
// The same range check for a value set in code.
Status ValidateFidelityGuard(double min_cosine);

// One request's reference queries, per layer: the query that made the layer's selection, with
// RoPE's rotation taken out (content space), so that a query does not "drift" only because its
// position moved on.
class QueryDriftGuard {
 public:
  // RoPE's inverse frequencies ([head_dim / 2], kernels/cpu/rope.h) and the query shape.
  struct Shape {
    int num_heads = 0;
    int head_dim = 0;
    const float* inv_freq = nullptr;  // [head_dim / 2]
  };

  // The mean over the query heads of the cosine between `query` ([num_heads][head_dim], after
  // RoPE, at `position`) and the reference of `layer`, both with RoPE taken out: 1 for the
  // same query content, -1 when `layer` has no reference yet.
  double LayerCosine(int layer, const float* query, int position, const Shape& shape) const;
  // Makes `query` at `position` the reference of `layer`.
  void Remember(int layer, const float* query, int position, const Shape& shape);
  bool HasReference(int layer) const;
  void Clear() { reference_.clear(); }

  // Whether a check with `cosine` fires under threshold `threshold` (> 0: the guard is on):
  // below the threshold, or always for a threshold of 1 (so "1" does not hang on rounding).
  static bool Fires(double threshold, double cosine) {
    return threshold >= 1.0 || cosine < threshold;
  }

 private:
  std::vector<std::vector<double>> reference_;  // [layer][num_heads * head_dim]; empty: none
  mutable std::vector<double> scratch_;         // one query, RoPE taken out
};

// What a policy counts of its guard (its stats line and metrics).
struct FidelityGuardCounters {
  int64_t checks = 0;   // steps (SFI) or (step, layer) pairs (Kascade) the guard judged
  int64_t firings = 0;  // of those, the ones it fired on
  int64_t steps = 0;    // decode steps of the policy's requests while the guard was on
};

// " <prefix>_guard_firings=F <prefix>_guard_firings_per_100_steps=R" (R = 100 F / steps, one
// decimal; 0 without steps).
std::string FidelityGuardStats(const std::string& prefix, const FidelityGuardCounters& counters);

}  // namespace rubato
