// The fidelity guard (docs/fidelity.md): a cheap per-step signal that the rows a policy attends
// were chosen for a query that no longer asks for them, shared by every policy that supports it.
// The signal is the drift of each query head since the query that made the current selection:
// the guard fires when the cosine of any head's query against its reference falls below
// `policy.fidelity_guard` (0 = off; 1 = every step). What a firing does is the policy's (SFI: the
// step is recomputed as a slow step; Kascade: a reuse layer selects its own top-k).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/yaml_map_reader.h"

namespace rubato {

// `policy.fidelity_guard`: the smallest cosine a query head may keep against its reference
// before the guard fires, in [0, 1]; 0 turns the guard off, 1 makes it fire on every check.
inline constexpr const char* kFidelityGuardKey = "fidelity_guard";

// Reads `policy.fidelity_guard` (absent: 0, off) from a policy section's reader; errors name the
// key ("policy.fidelity_guard: must be in [0, 1], got 1.5").
Status ReadFidelityGuard(YamlMapReader& params, double* min_cosine);
// The same range check for a value set in code.
Status ValidateFidelityGuard(double min_cosine);

// One request's reference queries, per layer ([num_heads][head_dim], f32), and the decision.
class QueryDriftGuard {
 public:
  // The smallest cosine over the heads of `query` ([num_heads][head_dim]) against the reference
  // of `layer`; 1 when every pair is parallel, -1 when `layer` has no reference yet.
  double MinCosine(int layer, const float* query, int num_heads, int head_dim) const;
  // Makes `query` the reference of `layer` (the query that made the layer's selection).
  void Remember(int layer, const float* query, int num_heads, int head_dim);
  bool HasReference(int layer) const;
  void Clear() { reference_.clear(); }

  // Whether a check with `min_cosine` fires under threshold `threshold` (> 0: the guard is on):
  // below the threshold, or always for a threshold of 1 (so "1" does not hang on rounding).
  static bool Fires(double threshold, double min_cosine) {
    return threshold >= 1.0 || min_cosine < threshold;
  }

 private:
  std::vector<std::vector<float>> reference_;  // [layer][num_heads * head_dim]; empty: none
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
