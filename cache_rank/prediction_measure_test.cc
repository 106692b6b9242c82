// AsyncSpade's prediction counters (prediction_measure.h): the cosine and hit counts the CPU
// selector and the GPU cache rank share, the GPU cache rank's per-entry plan (which steps compare,
// which measure the overlap and over which candidates), and the CPU twins of its counter ops.
#include "cache_rank/prediction_measure.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/dtype.h"

namespace rubato {
namespace {

TEST(PredictionMeasure, CosineAndHits) {
  const std::vector<float> a = {1, 2, 3, 4}, b = {2, 4, 6, 8}, c = {-1, -2, -3, -4};
  const std::vector<float> zero(4, 0.0f);
  EXPECT_NEAR(QueryCosine(a.data(), b.data(), 4), 1.0, 1e-12);
  EXPECT_NEAR(QueryCosine(a.data(), c.data(), 4), -1.0, 1e-12);
  EXPECT_EQ(QueryCosine(zero.data(), zero.data(), 4), 1.0);  // both zero
  EXPECT_EQ(QueryCosine(a.data(), zero.data(), 4), 0.0);     // one zero
  const std::vector<int32_t> exact = {3, 5, 9, 12};
  EXPECT_EQ(SelectionHits(exact, std::vector<int32_t>{12, 0, 5, 7, 1}), 2u);
  EXPECT_EQ(SelectionHits(exact, std::vector<int32_t>{}), 0u);
  EXPECT_EQ(SelectionHits({}, std::vector<int32_t>{3}), 0u);
}

TEST(PredictionMeasure, PlanFollowsTheSelectorsCadence) {
  PredictionMeasureRule rule;
  rule.top_k = 8;
  rule.sink_tokens = 4;
  rule.recent_tokens = 16;
  rule.overlap_every = 2;
  uint64_t steps = 0;
  // A prompt chunk, a token without a prediction, one whose prediction was for another position.
  EXPECT_FALSE(PlanEntryMeasure(rule, 100, 5, 100, &steps).cosine);
  EXPECT_FALSE(PlanEntryMeasure(rule, 100, 1, -1, &steps).cosine);
  EXPECT_FALSE(PlanEntryMeasure(rule, 100, 1, 99, &steps).cosine);
  EXPECT_EQ(steps, 0u);
  // Compared: the first step only the cosine, the second also the overlap over the candidates
  // of the step that ended at 100 positions, [4, 84).
  EntryMeasure m = PlanEntryMeasure(rule, 100, 1, 100, &steps);
  EXPECT_TRUE(m.cosine);
  EXPECT_EQ(m.overlap_count, 0);
  m = PlanEntryMeasure(rule, 101, 1, 101, &steps);
  EXPECT_TRUE(m.cosine);
  EXPECT_EQ(m.overlap_begin, 4);
  EXPECT_EQ(m.overlap_count, 101 - 16 - 4);
  EXPECT_EQ(steps, 2u);
  // Candidates not outnumbering top_k: no overlap (steps still count).
  m = PlanEntryMeasure(rule, 27, 1, 27, &steps);
  m = PlanEntryMeasure(rule, 28, 1, 28, &steps);
  EXPECT_TRUE(m.cosine);
  EXPECT_EQ(m.overlap_count, 0);  // 28 - 16 - 4 = 8 candidates, top_k 8
  m = PlanEntryMeasure(rule, 5, 1, 5, &steps);
  m = PlanEntryMeasure(rule, 6, 1, 6, &steps);
  EXPECT_EQ(m.overlap_count, 0);  // no candidates at all
  rule.overlap_every = 0;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(PlanEntryMeasure(rule, 200 + i, 1, 200 + i, &steps).overlap_count, 0);
  }
}

TEST(PredictionMeasure, CosineTwinReadsSlotsRowsAndFlags) {
  constexpr int kSlots = 3, kHeads = 2, kDim = 4;
  constexpr int64_t kStride = 12;
  std::vector<float> predicted(size_t{kSlots} * kHeads * kDim);
  for (size_t i = 0; i < predicted.size(); ++i) predicted[i] = static_cast<float>(i % 7) - 2.5f;
  std::vector<uint16_t> rows(3 * kStride);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = F32ToBf16(static_cast<float>(i % 5) - 1.0f);
  const std::vector<int32_t> slot = {2, 0, 7, 1}, row = {1, 0, 2, 2}, measure = {1, 1, 1, 0};
  std::vector<double> cosines(slot.size() * kHeads, -9.0);
  double sum = 0;
  uint64_t count = 0;
  PredictionCosineCpu(predicted, rows, kStride, slot, row, measure, kSlots, kHeads, kDim, cosines,
                      sum, count);
  EXPECT_EQ(count, 4u);  // entries 0 and 1: entry 2's slot is outside, entry 3 not measured
  double expected_sum = 0;
  for (int e = 0; e < 2; ++e) {
    for (int h = 0; h < kHeads; ++h) {
      float actual[kDim];
      for (int d = 0; d < kDim; ++d) actual[d] = Bf16ToF32(rows[row[e] * kStride + h * kDim + d]);
      const double want = QueryCosine(
          &predicted[(size_t{static_cast<size_t>(slot[e])} * kHeads + h) * kDim], actual, kDim);
      EXPECT_EQ(cosines[e * kHeads + h], want);
      expected_sum += want;
    }
  }
  EXPECT_EQ(sum, expected_sum);
  for (size_t i = 4; i < cosines.size(); ++i) EXPECT_EQ(cosines[i], -9.0);
}

TEST(PredictionMeasure, OverlapTwinReadsSlotMaps) {
  constexpr int kKvHeads = 2, kK = 4, kCapacity = 6, kMaps = 3;
  // Maps [map][kv head][1 + capacity]: the count, then the positions (sink 0 and 1 first).
  std::vector<int32_t> maps(size_t{kMaps} * kKvHeads * (1 + kCapacity), -1);
  const auto set = [&](int map, int g, std::vector<int32_t> held) {
    int32_t* at = &maps[(size_t{static_cast<size_t>(map)} * kKvHeads + g) * (1 + kCapacity)];
    at[0] = static_cast<int32_t>(held.size());
    for (size_t i = 0; i < held.size(); ++i) at[1 + i] = held[i];
  };
  set(2, 0, {0, 1, 9, 4, 7, 20});
  set(2, 1, {0, 1, 5});
  set(0, 0, {0, 1, 30, 31, 32, 33});
  set(0, 1, {});
  // Entry 0 on map 2, entry 1 on map 0, entry 2 on no map.
  const std::vector<int32_t> map_index = {2, 0, 5};
  const std::vector<int32_t> exact = {4,      7, 8, 20, /**/ 5, 6, 0, 0, /**/ 30, 31, 40, 41,
                                      /**/ 2, 3, 4, 5,  /**/ 1, 2, 3, 4, /**/ 1,  2,  3,  4};
  const std::vector<int32_t> exact_count = {4, 2, 4, 9, 3, 3};  // 9 clamps to k
  std::vector<int32_t> hits(6, -1);
  uint64_t hit_sum = 0, total_sum = 0;
  SelectionOverlapCpu(exact, exact_count, kK, maps, kMaps, map_index, 3, kKvHeads, kCapacity, hits,
                      hit_sum, total_sum);
  EXPECT_EQ(hits, (std::vector<int32_t>{3, 1, 2, 0, 0, 0}));
  EXPECT_EQ(hit_sum, 6u);
  EXPECT_EQ(total_sum, 4u + 2u + 4u + 4u);  // entry 2 (no map) adds nothing
}

}  // namespace
}  // namespace rubato
