// The CPU twin of group_max_probs.cuh for one row: the R-head's GQA group's softmax of log2
// scores over [0, length), max-pooled over the group, excluded positions -inf.
#pragma once

#include <cstdint>

namespace rubato {

// scores: [group][scores_stride] log2 units; excluded: `excluded_count` ascending positions (may
// be null when 0); out: [length].
void GroupMaxProbsRow(const float* scores, int64_t scores_stride, int group, int length,
                      const int32_t* excluded, int excluded_count, float* out);

}  // namespace rubato
