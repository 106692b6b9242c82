// The fidelity guard's signal, config key and stats (see fidelity_guard.h).
#include "inference_rank/attention/fidelity_guard.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace rubato {

Status ReadFidelityGuard(YamlMapReader& params, double* min_cosine) {
  return params.ReadDouble(kFidelityGuardKey, DoubleRange{0.0, 1.0, true, true}, min_cosine);
}

Status ValidateFidelityGuard(double min_cosine) {
  if (min_cosine >= 0.0 && min_cosine <= 1.0) return Status::Ok();
  return InvalidArgumentError("policy.fidelity_guard: must be in [0, 1] (0 = off), got " +
                              std::to_string(min_cosine));
}

double QueryDriftGuard::MinCosine(int layer, const float* query, int num_heads,
                                  int head_dim) const {
  if (!HasReference(layer)) return -1.0;
  const std::vector<float>& reference = reference_[static_cast<size_t>(layer)];
  double smallest = 1.0;
  for (int h = 0; h < num_heads; ++h) {
    const float* a = query + static_cast<size_t>(h) * head_dim;
    const float* b = reference.data() + static_cast<size_t>(h) * head_dim;
    double dot = 0.0, aa = 0.0, bb = 0.0;
    for (int d = 0; d < head_dim; ++d) {
      dot += static_cast<double>(a[d]) * b[d];
      aa += static_cast<double>(a[d]) * a[d];
      bb += static_cast<double>(b[d]) * b[d];
    }
    // A zero query has no direction: it asks for nothing the reference did not.
    const double cosine = aa > 0.0 && bb > 0.0 ? dot / std::sqrt(aa * bb) : 1.0;
    smallest = std::min(smallest, cosine);
  }
  return smallest;
}

void QueryDriftGuard::Remember(int layer, const float* query, int num_heads, int head_dim) {
  if (reference_.size() <= static_cast<size_t>(layer)) {
    reference_.resize(static_cast<size_t>(layer) + 1);
  }
  reference_[static_cast<size_t>(layer)].assign(query,
                                                query + static_cast<size_t>(num_heads) * head_dim);
}

bool QueryDriftGuard::HasReference(int layer) const {
  return layer >= 0 && static_cast<size_t>(layer) < reference_.size() &&
         !reference_[static_cast<size_t>(layer)].empty();
}

std::string FidelityGuardStats(const std::string& prefix, const FidelityGuardCounters& counters) {
  const double per_100 =
      counters.steps > 0 ? 100.0 * static_cast<double>(counters.firings) / counters.steps : 0.0;
  char rate[32];
  std::snprintf(rate, sizeof(rate), "%.1f", per_100);
  return " " + prefix + "_guard_firings=" + std::to_string(counters.firings) + " " + prefix +
         "_guard_firings_per_100_steps=" + rate;
}

}  // namespace rubato
