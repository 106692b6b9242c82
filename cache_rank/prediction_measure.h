// How well AsyncSpade's next-query prediction did: the math of the CPU selector's counters
// (selectors/asyncspade_selector.cc), the GPU cache rank's per-entry plan of what a step
// measures, and the CPU twins of its two counter ops
// (inference_rank/residency/offloaded/kernels/prediction_cosine.cuh, selection_overlap.cuh).
// docs/asyncspade.md "Counters".
#pragma once

#include <math.h>

#include <cstdint>
#include <span>

#if defined(__CUDACC__)
#define RUBATO_MEASURE_HOST_DEVICE __host__ __device__
#else
#define RUBATO_MEASURE_HOST_DEVICE
#endif

namespace rubato {

// The cosine of two vectors from their sums a.b, a.a and b.b (double): 1 when both are zero, 0
// when one is. The device op computes its sums in the same way.
RUBATO_MEASURE_HOST_DEVICE inline double CosineFromSums(double ab, double aa, double bb) {
  return aa > 0 && bb > 0 ? ab / sqrt(aa * bb) : (aa == bb ? 1.0 : 0.0);
}

// The cosine of a predicted query head against the one that came, `n` elements.
double QueryCosine(const float* predicted, const float* actual, uint32_t n);

// |exact ∩ chosen|: `exact` strictly ascending (a top-k), `chosen` distinct in any order (a
// selection, or the positions of a compact slot map).
uint64_t SelectionHits(std::span<const int32_t> exact, std::span<const int32_t> chosen);

// What the GPU cache rank measures for one entry of a step (GpuCacheTopK::PlanPrediction), by
// the CPU selector's rule: a decode token whose session's last prediction was made for its
// position compares its query with it (`cosine`), and every overlap_every such steps of the
// session, where the prediction's candidates outnumber top_k, the exact top_k of its query over
// those candidates [overlap_begin, overlap_begin + overlap_count) against the predicted
// selection. The prediction's candidates are the store's for the step that ended at the
// entry's position L: [min(sink, max(0, L - recent)), max(0, L - recent)).
struct PredictionMeasureRule {
  int top_k = 0;
  int sink_tokens = 0;
  int recent_tokens = 1;
  int overlap_every = 0;  // 0: never
};
struct EntryMeasure {
  bool cosine = false;
  int overlap_begin = 0;
  int overlap_count = 0;  // 0: no overlap this step
};
// `predicted_position`: the position the session's last prediction was made for (-1: none);
// `compared_steps`: the session's compared steps so far, advanced when this one compares.
EntryMeasure PlanEntryMeasure(const PredictionMeasureRule& rule, int first_position, int tokens,
                              int predicted_position, uint64_t* compared_steps);

// CPU twin of cuda::PredictionCosine. For every entry e with measure[e] != 0 and slot[e] in
// [0, slots), and every head h: the cosine (QueryCosine) of predicted[(slot[e] * heads + h) *
// dim ..] (fp32) against the bf16 query at rows[row[e] * row_stride + h * dim ..], written to
// cosines[e * heads + h] when `cosines` is not empty (the others left as they are), added to
// `cosine_sum` and counted in `cosine_count`.
void PredictionCosineCpu(std::span<const float> predicted, std::span<const uint16_t> rows,
                         int64_t row_stride, std::span<const int32_t> slot,
                         std::span<const int32_t> row, std::span<const int32_t> measure, int slots,
                         int heads, int dim, std::span<double> cosines, double& cosine_sum,
                         uint64_t& cosine_count);

// CPU twin of cuda::SelectionOverlap. For every entry b and KV head g: the exact top-k
// exact[(b * kv_heads + g) * k ..], exact_count[b * kv_heads + g] of them (clamped to [0, k]),
// against the compact slot map of (map_index[b], g): maps[(map_index[b] * kv_heads + g) * (1 +
// capacity)] its count (clamped to [0, capacity]), then the position in each slot.
// hits[b * kv_heads + g] = SelectionHits (when `hits` is not empty), summed into `hit_sum`, and
// the exact count into `total_sum`. An entry whose map_index is outside [0, num_maps) adds
// nothing (its hits 0).
void SelectionOverlapCpu(std::span<const int32_t> exact, std::span<const int32_t> exact_count,
                         int k, std::span<const int32_t> maps, int num_maps,
                         std::span<const int32_t> map_index, int batch, int kv_heads, int capacity,
                         std::span<int32_t> hits, uint64_t& hit_sum, uint64_t& total_sum);

}  // namespace rubato
