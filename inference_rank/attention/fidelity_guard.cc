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

namespace {

// `query` ([num_heads][head_dim], rotated by RoPE at `position`) rotated back, into `out`:
// the inverse of kernels/cpu/rope.h ApplyRope's rotation of each (i, i + half) pair.
void Unrotate(const float* query, int position, const QueryDriftGuard::Shape& shape,
              std::vector<double>& out) {
  const int half = shape.head_dim / 2;
  out.resize(static_cast<size_t>(shape.num_heads) * shape.head_dim);
  for (int i = 0; i < half; ++i) {
    const double angle = static_cast<double>(position) * shape.inv_freq[i];
    const double c = std::cos(angle), s = std::sin(angle);
    for (int h = 0; h < shape.num_heads; ++h) {
      const size_t at = static_cast<size_t>(h) * shape.head_dim;
      const double x1 = query[at + i], x2 = query[at + i + half];
      out[at + i] = x1 * c + x2 * s;
      out[at + i + half] = x2 * c - x1 * s;
    }
  }
}

}  // namespace

double QueryDriftGuard::LayerCosine(int layer, const float* query, int position,
                                    const Shape& shape) const {
  if (!HasReference(layer)) return -1.0;
  const std::vector<double>& reference = reference_[static_cast<size_t>(layer)];
  Unrotate(query, position, shape, scratch_);
  double mean = 0.0;
  for (int h = 0; h < shape.num_heads; ++h) {
    const double* a = scratch_.data() + static_cast<size_t>(h) * shape.head_dim;
    const double* b = reference.data() + static_cast<size_t>(h) * shape.head_dim;
    double dot = 0.0, aa = 0.0, bb = 0.0;
    for (int d = 0; d < shape.head_dim; ++d) {
      dot += a[d] * b[d];
      aa += a[d] * a[d];
      bb += b[d] * b[d];
    }
    // A zero query has no direction: it asks for nothing the reference did not.
    mean += (aa > 0.0 && bb > 0.0 ? dot / std::sqrt(aa * bb) : 1.0) / shape.num_heads;
  }
  return mean;
}

void QueryDriftGuard::Remember(int layer, const float* query, int position, const Shape& shape) {
  if (reference_.size() <= static_cast<size_t>(layer)) {
    reference_.resize(static_cast<size_t>(layer) + 1);
  }
  Unrotate(query, position, shape, reference_[static_cast<size_t>(layer)]);
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
