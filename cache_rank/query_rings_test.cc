// The query rings' CPU twins (query_rings.h), which the GPU cache rank's AsyncSpade mirrors on
// the device: pushing step entries' queries and predicting from the rings equals QueryWindow
// (the CPU selector's window) fed the same queries, across wrap-around, a prompt chunk that
// restarts the window and a slot left alone; packing predicted queries rounds to bf16 as
// F32ToBf16 and zeroes an entry without a slot.
#include "cache_rank/query_rings.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cache_rank/query_predictor.h"
#include "common/dtype.h"

namespace rubato {
namespace {

TEST(QueryRings, PushAndPredictEqualTheSelectorsWindow) {
  constexpr int kSlots = 3, kHeads = 4, kDim = 8, kWindow = 3, kCapacity = kWindow + 1;
  constexpr int64_t kStride = kHeads * kDim + 16;  // q then k|v, as the step's rows
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> ring(size_t{kSlots} * kHeads * kCapacity * kDim, -7.0f);
  std::vector<int32_t> next(size_t{kSlots} * kHeads, 0), count(size_t{kSlots} * kHeads, 0);
  // Slots 0 and 2 step; slot 1 never does and stays empty.
  std::vector<QueryWindow> windows(2, QueryWindow(kHeads, kWindow, kDim));
  for (int step = 0; step < 9; ++step) {
    // Two entries: slot 2 at row 0 (decode), slot 0 at rows 1..3 (a chunk at steps 0 and 5,
    // whose last query is row 3; a decode token at row 1 otherwise).
    const bool chunk = step == 0 || step == 5;
    const int rows = 4;
    std::vector<uint16_t> qkv(size_t{rows} * kStride);
    for (uint16_t& x : qkv) x = F32ToBf16(normal(rng));
    const std::vector<int32_t> slot = {2, 0};
    const std::vector<int32_t> row = {0, chunk ? 3 : 1};
    const std::vector<int32_t> restart = {step == 0 ? 1 : 0, chunk ? 1 : 0};
    PushQueryRowsCpu(ring, next, count, qkv, kStride, {slot, row, restart}, kSlots, kHeads,
                     kCapacity, kDim);
    for (int e = 0; e < 2; ++e) {
      std::vector<float> q(size_t{kHeads} * kDim);
      for (size_t i = 0; i < q.size(); ++i) q[i] = Bf16ToF32(qkv[size_t(row[e]) * kStride + i]);
      QueryWindow& window = windows[size_t(e)];
      if (restart[e] != 0) window = QueryWindow(kHeads, kWindow, kDim);
      window.Push(q);
    }
    std::vector<float> predicted(size_t{kSlots} * kHeads * kDim, -1.0f);
    PredictQueriesFromRings(ring, next, count, kSlots * kHeads, kCapacity, kDim, kWindow, 1e-2,
                            predicted);
    for (int e = 0; e < 2; ++e) {
      std::vector<float> want(size_t{kHeads} * kDim);
      windows[size_t(e)].Predict(1e-2, want);
      const size_t base = size_t(slot[e]) * kHeads * kDim;
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(predicted[base + i], want[i])
            << "step " << step << " slot " << slot[e] << " " << i;
      }
      EXPECT_EQ(count[size_t(slot[e]) * kHeads], windows[size_t(e)].size()) << "step " << step;
    }
    for (int h = 0; h < kHeads; ++h) {
      EXPECT_EQ(count[kHeads + h], 0);  // slot 1: untouched, predicts zeros
      for (int d = 0; d < kDim; ++d) EXPECT_EQ(predicted[(kHeads + h) * kDim + d], 0.0f);
    }
  }
}

TEST(QueryRings, PushRestartsARingWithABadNextAndSkipsBadSlots) {
  std::vector<float> ring(2 * 2 * 4, 0.0f);  // 1 slot, 1 head, capacity 2, dim 4... and spare
  std::vector<int32_t> next = {5}, count = {2};
  const std::vector<uint16_t> rows = {F32ToBf16(1), F32ToBf16(2), F32ToBf16(3), F32ToBf16(4)};
  const std::vector<int32_t> slot = {0, 1, -1}, row = {0, 0, 0}, restart = {0, 0, 0};
  PushQueryRowsCpu(ring, next, count, rows, 4, {slot, row, restart}, 1, 1, 2, 4);
  EXPECT_EQ(next[0], 1);
  EXPECT_EQ(count[0], 1);
  EXPECT_EQ(ring[0], 1.0f);
  EXPECT_EQ(ring[3], 4.0f);
}

TEST(QueryRings, PackRoundsToBf16AndZeroesEntriesWithoutASlot) {
  constexpr int kSlots = 2, kHeads = 2, kDim = 4;
  std::vector<float> predicted(size_t{kSlots} * kHeads * kDim);
  for (size_t i = 0; i < predicted.size(); ++i) predicted[i] = 1.0f + 1e-3f * float(i) / 3.0f;
  const std::vector<int32_t> slot = {1, 7, 0};
  constexpr int64_t kStride = 16;
  std::vector<uint16_t> out(3 * kStride, 0xffff);
  PackPredictedQueriesCpu(predicted, slot, kSlots, kHeads, kDim, kStride, out);
  for (int i = 0; i < kHeads * kDim; ++i) {
    EXPECT_EQ(out[size_t(i)], F32ToBf16(predicted[size_t(kHeads * kDim + i)]));
    EXPECT_EQ(out[size_t(kStride + i)], 0);
    EXPECT_EQ(out[size_t(2 * kStride + i)], F32ToBf16(predicted[size_t(i)]));
  }
  EXPECT_EQ(out[kHeads * kDim], 0xffff);  // past the row: untouched
}

}  // namespace
}  // namespace rubato
