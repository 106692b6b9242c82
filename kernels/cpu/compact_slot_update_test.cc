// CompactSlotUpdate (compact_slot_update.h) against the cache rank's slot map
// (transport/compact_delta.h CompactSlotMap): over 200 steps of changing selections (sink rows
// that grow, selections that grow and shrink, most rows staying, resets), the batched update
// writes the same deltas and holds the same maps; bad arguments are refused by name.
#include "kernels/cpu/compact_slot_update.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "transport/compact_delta.h"

namespace rubato {
namespace {

// Per (sequence, KV head), the next selection: keep most of `previous` (past the sink), add
// fresh positions in [sink, horizon), at most `budget` selected.
std::vector<int32_t> NextSelected(std::mt19937& random, const std::vector<int32_t>& previous,
                                  int sink, int horizon, int budget) {
  std::set<int32_t> chosen;
  for (const int32_t p : previous) {
    if (p >= sink && random() % 5 != 0) chosen.insert(p);
  }
  const int target = static_cast<int>(random() % static_cast<unsigned>(budget + 1));
  while (static_cast<int>(chosen.size()) > target) {
    auto it = chosen.begin();
    std::advance(it, random() % chosen.size());
    chosen.erase(it);
  }
  const int room = horizon - sink;
  while (static_cast<int>(chosen.size()) < std::min(target, room)) {
    chosen.insert(sink + static_cast<int32_t>(random() % static_cast<unsigned>(room)));
  }
  return {chosen.begin(), chosen.end()};
}

TEST(CompactSlotUpdateTest, EqualsTheSlotMapOverTwoHundredSteps) {
  constexpr int kBatch = 3, kHeads = 2, kMaps = 5, kMaxSink = 4, kBudget = 20;
  constexpr int kCapacity = kMaxSink + kBudget + 3;
  std::mt19937 random(11);
  const std::vector<int32_t> map_index = {3, 0, 4};
  std::vector<int32_t> maps(size_t{kMaps} * kHeads * (1 + kCapacity), 0);
  std::vector<CompactSlotMap> reference(size_t{kBatch} * kHeads, CompactSlotMap(kCapacity));
  std::vector<std::vector<int32_t>> previous(size_t{kBatch} * kHeads);
  size_t entering_rows = 0, selected_rows = 0;
  for (int step = 0; step < 200; ++step) {
    std::vector<int32_t> sink_end(kBatch), reset(kBatch);
    std::vector<int32_t> selected(size_t{kBatch} * kHeads * kBudget, -7);
    std::vector<int32_t> selected_count(size_t{kBatch} * kHeads);
    for (int b = 0; b < kBatch; ++b) {
      sink_end[b] = std::min(kMaxSink, step / 3 + b);  // grows in the first steps
      reset[b] = step == 0 || random() % 40 == 0 ? 1 : 0;
      for (int h = 0; h < kHeads; ++h) {
        const size_t pair = size_t{static_cast<size_t>(b)} * kHeads + h;
        previous[pair] =
            NextSelected(random, previous[pair], sink_end[b], sink_end[b] + 30 + step, kBudget);
        selected_count[pair] = static_cast<int32_t>(previous[pair].size());
        std::copy(previous[pair].begin(), previous[pair].end(), selected.begin() + pair * kBudget);
      }
    }
    std::vector<int32_t> counts(size_t{kBatch} * kHeads, -5), entering(counts.size(), -5);
    std::vector<int32_t> slots(counts.size() * kCapacity, -5), positions(slots.size(), -5);
    CompactSlotUpdateArgs args;
    args.maps = maps.data();
    args.num_maps = kMaps;
    args.map_index = map_index.data();
    args.reset = reset.data();
    args.sink_end = sink_end.data();
    args.max_sink_tokens = kMaxSink;
    args.selected = selected.data();
    args.selected_count = selected_count.data();
    args.budget = kBudget;
    args.batch = kBatch;
    args.num_kv_heads = kHeads;
    args.capacity = kCapacity;
    args.counts = counts.data();
    args.entering = entering.data();
    args.entering_slots = slots.data();
    args.entering_positions = positions.data();
    ASSERT_TRUE(CompactSlotUpdate(args).ok()) << "step " << step;
    for (int b = 0; b < kBatch; ++b) {
      for (int h = 0; h < kHeads; ++h) {
        const size_t pair = size_t{static_cast<size_t>(b)} * kHeads + h;
        std::vector<int32_t> selection;
        for (int i = 0; i < sink_end[b]; ++i) selection.push_back(i);
        selection.insert(selection.end(), previous[pair].begin(), previous[pair].end());
        CompactSlotMap& map = reference[pair];
        auto delta = reset[b] != 0 ? map.Reset(selection) : map.Update(selection);
        ASSERT_TRUE(delta.ok()) << delta.status().message();
        SCOPED_TRACE(testing::Message() << "step " << step << " sequence " << b << " head " << h);
        ASSERT_EQ(counts[pair], delta->count);
        ASSERT_EQ(entering[pair], static_cast<int32_t>(delta->slots.size()));
        for (int i = 0; i < kCapacity; ++i) {
          const bool in = i < entering[pair];
          ASSERT_EQ(slots[pair * kCapacity + i], in ? delta->slots[i] : -1) << "row " << i;
          ASSERT_EQ(positions[pair * kCapacity + i], in ? delta->positions[i] : -1) << "row " << i;
        }
        const int32_t* held =
            maps.data() +
            (size_t{static_cast<size_t>(map_index[b])} * kHeads + h) * (1 + kCapacity);
        ASSERT_EQ(held[0], map.count());
        for (int s = 0; s < map.count(); ++s) ASSERT_EQ(held[1 + s], map.slot_positions()[s]);
        entering_rows += delta->slots.size();
        selected_rows += selection.size();
      }
    }
  }
  // Most rows stay from step to step: the deltas are a fraction of the full replies.
  EXPECT_LT(entering_rows * 2, selected_rows);
}

TEST(CompactSlotUpdateTest, RefusesBadArgumentsByName) {
  std::vector<int32_t> maps(2 * (1 + 4), 0), map_index = {2}, sink_end = {1};
  std::vector<int32_t> selected = {3, 2}, selected_count = {2};
  std::vector<int32_t> counts(1), entering(1), slots(4), positions(4);
  CompactSlotUpdateArgs args;
  args.maps = maps.data();
  args.num_maps = 2;
  args.map_index = map_index.data();
  args.sink_end = sink_end.data();
  args.max_sink_tokens = 1;
  args.selected = selected.data();
  args.selected_count = selected_count.data();
  args.budget = 2;
  args.batch = 1;
  args.num_kv_heads = 1;
  args.capacity = 4;
  args.counts = counts.data();
  args.entering = entering.data();
  args.entering_slots = slots.data();
  args.entering_positions = positions.data();
  Status status = CompactSlotUpdate(args);
  EXPECT_NE(status.message().find("map_index[0] = 2"), std::string::npos) << status.message();
  map_index[0] = 1;
  status = CompactSlotUpdate(args);
  EXPECT_NE(status.message().find("selected[1] = 2"), std::string::npos) << status.message();
  selected = {2, 3};
  args.capacity = 2;
  status = CompactSlotUpdate(args);
  EXPECT_NE(status.message().find("capacity = 2"), std::string::npos) << status.message();
  args.capacity = 4;
  ASSERT_TRUE(CompactSlotUpdate(args).ok());
  EXPECT_EQ(counts[0], 3);
  EXPECT_EQ(entering[0], 3);
  EXPECT_EQ(std::vector<int32_t>(maps.begin() + 5, maps.begin() + 9),
            (std::vector<int32_t>{3, 0, 2, 3}));
}

}  // namespace
}  // namespace rubato
