// Delta replies' bookkeeping (compact_delta.h): over many steps of changing selections, a pool
// fed only the entering rows holds exactly the (position, row) pairs a full reply carries; the
// pool refuses deltas that would leave it inconsistent.
#include "transport/compact_delta.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

namespace rubato {
namespace {

constexpr int kHeadDim = 3;

// The K / V row a synthetic store holds at `position` of KV head `head`.
std::vector<float> RowAt(int head, int32_t position, float salt) {
  std::vector<float> row(kHeadDim);
  for (int d = 0; d < kHeadDim; ++d) row[d] = salt + head * 1000.0f + position + 0.25f * d;
  return row;
}

// Gathers the entering rows of `delta` as a reply would carry them.
void Rows(int head, const CompactDelta& delta, std::vector<float>& keys,
          std::vector<float>& values) {
  keys.clear();
  values.clear();
  for (const int32_t position : delta.positions) {
    const auto k = RowAt(head, position, 0.0f);
    const auto v = RowAt(head, position, 0.5f);
    keys.insert(keys.end(), k.begin(), k.end());
    values.insert(values.end(), v.begin(), v.end());
  }
}

// The pool's rows of `head` as (position -> key row, value row).
std::map<int32_t, std::pair<std::vector<float>, std::vector<float>>> PoolRows(CompactPool& pool,
                                                                              int head) {
  std::map<int32_t, std::pair<std::vector<float>, std::vector<float>>> rows;
  const std::span<const int32_t> positions = pool.positions(head);
  for (size_t slot = 0; slot < positions.size(); ++slot) {
    const size_t at = (static_cast<size_t>(head) * pool.capacity() + slot) * kHeadDim;
    rows[positions[slot]] = {std::vector<float>(pool.keys() + at, pool.keys() + at + kHeadDim),
                             std::vector<float>(pool.values() + at, pool.values() + at + kHeadDim)};
  }
  return rows;
}

TEST(CompactDeltaTest, DeltasRebuildTheFullReplyOverTwoHundredSteps) {
  constexpr int kHeads = 2;
  constexpr int kCapacity = 24;
  std::mt19937 random(7);
  std::vector<CompactSlotMap> maps(kHeads, CompactSlotMap(kCapacity));
  CompactPool pool(kHeads, kCapacity, kHeadDim);
  std::vector<std::vector<int32_t>> previous(kHeads);
  size_t entering_rows = 0, full_rows = 0;
  int context = 8;
  std::vector<float> keys, values;
  for (int step = 0; step < 200; ++step) {
    context += 1;
    for (int h = 0; h < kHeads; ++h) {
      // Most steps keep most of the last selection (temporal locality), some shrink it (a
      // moving count), some draw a fresh one, and every 50th is a full reply (a reset).
      std::set<int32_t> chosen;
      const int want = std::min<int>(context, step % 37 == 5 ? kCapacity / 2 : kCapacity);
      if (step % 11 != 3) {
        for (const int32_t p : previous[h]) {
          if (static_cast<int>(chosen.size()) < want && random() % 5 != 0) chosen.insert(p);
        }
      }
      while (static_cast<int>(chosen.size()) < want) {
        chosen.insert(static_cast<int32_t>(random() % context));
      }
      const std::vector<int32_t> selection(chosen.begin(), chosen.end());
      const Result<CompactDelta> delta =
          step % 50 == 49 ? maps[h].Reset(selection) : maps[h].Update(selection);
      ASSERT_TRUE(delta.ok()) << delta.status().message();
      Rows(h, *delta, keys, values);
      const Status applied = pool.Apply(h, *delta, keys, values);
      ASSERT_TRUE(applied.ok()) << "step " << step << ": " << applied.message();
      entering_rows += delta->positions.size();
      full_rows += selection.size();

      // The full reply: every selected row.
      std::map<int32_t, std::pair<std::vector<float>, std::vector<float>>> full;
      for (const int32_t p : selection) full[p] = {RowAt(h, p, 0.0f), RowAt(h, p, 0.5f)};
      ASSERT_EQ(pool.counts()[h], static_cast<int>(selection.size())) << "step " << step;
      ASSERT_EQ(PoolRows(pool, h), full) << "step " << step << " head " << h;
      ASSERT_TRUE(std::equal(maps[h].slot_positions().begin(), maps[h].slot_positions().end(),
                             pool.positions(h).begin(), pool.positions(h).end()));
      previous[h] = selection;
    }
  }
  // With locality the deltas carry far fewer rows than full replies.
  EXPECT_LT(entering_rows * 2, full_rows) << entering_rows << " of " << full_rows;
}

TEST(CompactDeltaTest, AnUnchangedSelectionSendsNothing) {
  CompactSlotMap map(4);
  const std::vector<int32_t> selection{1, 5, 9};
  ASSERT_TRUE(map.Update(selection).ok());
  const Result<CompactDelta> again = map.Update(selection);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->reset);
  EXPECT_EQ(again->count, 3);
  EXPECT_TRUE(again->slots.empty());
}

TEST(CompactDeltaTest, FreedSlotsAreReusedLowestFirst) {
  CompactSlotMap map(4);
  ASSERT_TRUE(map.Update(std::vector<int32_t>{1, 5, 9, 12}).ok());  // slots 0..3
  const Result<CompactDelta> delta = map.Update(std::vector<int32_t>{2, 5, 12, 20});
  ASSERT_TRUE(delta.ok());
  EXPECT_EQ(delta->slots, (std::vector<int32_t>{0, 2}));  // 1 and 9 left slots 0 and 2
  EXPECT_EQ(delta->positions, (std::vector<int32_t>{2, 20}));
}

TEST(CompactDeltaTest, TheSlotMapRefusesAnUnorderedOrOversizedSelection) {
  CompactSlotMap map(2);
  EXPECT_FALSE(map.Update(std::vector<int32_t>{3, 1}).ok());
  EXPECT_FALSE(map.Update(std::vector<int32_t>{1, 2, 3}).ok());
}

TEST(CompactDeltaTest, ThePoolRefusesInconsistentDeltas) {
  CompactPool pool(1, 4, kHeadDim);
  const std::vector<float> row(kHeadDim, 1.0f);
  const std::vector<float> two_rows(2 * kHeadDim, 1.0f);
  const std::vector<int32_t> one{0}, positions_two{3, 4};
  // A slot below the count left empty.
  Status status = pool.Apply(0, false, 2, one, std::vector<int32_t>{7}, row, row);
  EXPECT_NE(status.message().find("slot 1 of the 2 in use is left empty"), std::string::npos)
      << status.message();
  // A slot written twice.
  status = pool.Apply(0, true, 2, std::vector<int32_t>{0, 0}, positions_two, two_rows, two_rows);
  EXPECT_NE(status.message().find("written twice"), std::string::npos) << status.message();
  // A count past the capacity.
  status = pool.Apply(0, true, 5, {}, {}, {}, {});
  EXPECT_NE(status.message().find("'count' 5"), std::string::npos) << status.message();
  EXPECT_EQ(pool.counts()[0], 0);  // unchanged by the refusals
}

}  // namespace
}  // namespace rubato
