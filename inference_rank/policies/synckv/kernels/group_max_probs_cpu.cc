// The CPU twin of the SyncKV selection evidence (see group_max_probs_cpu.h).
#include "inference_rank/policies/synckv/kernels/group_max_probs_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace rubato {

void GroupMaxProbsRow(const float* scores, int64_t scores_stride, int group, int length,
                      const int32_t* excluded, int excluded_count, float* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::fill(out, out + length, 0.0f);
  for (int g = 0; g < group; ++g) {
    const float* s = scores + g * scores_stride;
    float max = neg_inf;
    for (int p = 0; p < length; ++p) {
      if (std::isfinite(s[p])) max = std::max(max, s[p]);
    }
    if (max == neg_inf) continue;  // no finite score: the head adds nothing
    float sum = 0.0f;
    for (int p = 0; p < length; ++p) {
      if (std::isfinite(s[p])) sum += std::exp2(s[p] - max);
    }
    const float inverse = 1.0f / sum;
    for (int p = 0; p < length; ++p) {
      if (std::isfinite(s[p])) out[p] = std::max(out[p], std::exp2(s[p] - max) * inverse);
    }
  }
  for (int i = 0; i < excluded_count; ++i) {
    if (excluded[i] >= 0 && excluded[i] < length) out[excluded[i]] = neg_inf;
  }
}

}  // namespace rubato
