// AsyncSpade's prediction counters: the shared math, the GPU cache rank's plan per entry, and
// the CPU twins of its counter ops (prediction_measure.h).
#include "cache_rank/prediction_measure.h"

#include <algorithm>
#include <vector>

#include "common/dtype.h"

namespace rubato {

double QueryCosine(const float* predicted, const float* actual, uint32_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (uint32_t i = 0; i < n; ++i) {
    ab += double{predicted[i]} * actual[i];
    aa += double{predicted[i]} * predicted[i];
    bb += double{actual[i]} * actual[i];
  }
  return CosineFromSums(ab, aa, bb);
}

uint64_t SelectionHits(std::span<const int32_t> exact, std::span<const int32_t> chosen) {
  uint64_t hits = 0;
  for (const int32_t position : chosen) {
    if (std::binary_search(exact.begin(), exact.end(), position)) ++hits;
  }
  return hits;
}

EntryMeasure PlanEntryMeasure(const PredictionMeasureRule& rule, int first_position, int tokens,
                              int predicted_position, uint64_t* compared_steps) {
  EntryMeasure m;
  if (tokens != 1 || predicted_position < 0 || predicted_position != first_position) return m;
  m.cosine = true;
  ++*compared_steps;
  const int recent_begin = std::max(0, first_position - rule.recent_tokens);
  const int sink_end = std::min(rule.sink_tokens, recent_begin);
  const int candidates = recent_begin - sink_end;
  if (rule.overlap_every > 0 && *compared_steps % static_cast<uint64_t>(rule.overlap_every) == 0 &&
      candidates > rule.top_k) {
    m.overlap_begin = sink_end;
    m.overlap_count = candidates;
  }
  return m;
}

void PredictionCosineCpu(std::span<const float> predicted, std::span<const uint16_t> rows,
                         int64_t row_stride, std::span<const int32_t> slot,
                         std::span<const int32_t> row, std::span<const int32_t> measure, int slots,
                         int heads, int dim, std::span<double> cosines, double& cosine_sum,
                         uint64_t& cosine_count) {
  std::vector<float> actual(static_cast<size_t>(dim));
  for (size_t e = 0; e < measure.size(); ++e) {
    if (measure[e] == 0 || slot[e] < 0 || slot[e] >= slots) continue;
    for (int h = 0; h < heads; ++h) {
      const uint16_t* q = rows.data() + row[e] * row_stride + int64_t{h} * dim;
      for (int d = 0; d < dim; ++d) actual[static_cast<size_t>(d)] = Bf16ToF32(q[d]);
      const float* guess = predicted.data() + (static_cast<size_t>(slot[e]) * heads + h) * dim;
      const double cosine = QueryCosine(guess, actual.data(), static_cast<uint32_t>(dim));
      if (!cosines.empty()) cosines[e * static_cast<size_t>(heads) + h] = cosine;
      cosine_sum += cosine;
      ++cosine_count;
    }
  }
}

void SelectionOverlapCpu(std::span<const int32_t> exact, std::span<const int32_t> exact_count,
                         int k, std::span<const int32_t> maps, int num_maps,
                         std::span<const int32_t> map_index, int batch, int kv_heads, int capacity,
                         std::span<int32_t> hits, uint64_t& hit_sum, uint64_t& total_sum) {
  for (int b = 0; b < batch; ++b) {
    for (int g = 0; g < kv_heads; ++g) {
      const size_t pair = static_cast<size_t>(b) * kv_heads + g;
      if (!hits.empty()) hits[pair] = 0;
      const int map = map_index[static_cast<size_t>(b)];
      if (map < 0 || map >= num_maps) continue;
      const int n = std::clamp(exact_count[pair], 0, k);
      const int32_t* held =
          maps.data() + (static_cast<size_t>(map) * kv_heads + g) * (1 + capacity);
      const int held_count = std::clamp(held[0], 0, capacity);
      const uint64_t found =
          SelectionHits(exact.subspan(pair * k, static_cast<size_t>(n)),
                        std::span<const int32_t>(held + 1, static_cast<size_t>(held_count)));
      if (!hits.empty()) hits[pair] = static_cast<int32_t>(found);
      hit_sum += found;
      total_sum += static_cast<uint64_t>(n);
    }
  }
}

}  // namespace rubato
