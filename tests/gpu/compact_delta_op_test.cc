// Delta replies on the GPU, op by op against their CPU twins over many steps of changing
// selections: the cache rank's slot update (kernels/cuda/compact_slot_update.cuh) against
// kernels/cpu/compact_slot_update.h (every map entry and every delta entry equal), the gather
// of the entering rows into a delta pack (compact gather with the entering positions as its
// selection) against the rows at those positions (bit for bit), and the inference rank's
// scatter into persistent pools (kernels/cuda/compact_delta_scatter.cuh) against
// transport/compact_delta.h CompactPool::Apply (every row, position and count of every pool).
// Shapes: sinks 0 and 4, budgets 16 to 2048, 1 to 8 KV heads, head_dim 16 to 128, resets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/compact_slot_update.h"
#include "kernels/cuda/compact_delta_scatter.cuh"
#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/compact_slot_update.cuh"
#include "tests/gpu/gpu_test_util.h"
#include "transport/compact_delta.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::Poisoned;
using gpu_test::Upload;
using gpu_test::UploadBf16;

struct DeltaCase {
  int batch = 3;
  int heads = 2;
  int head_dim = 64;
  int block_tokens = 16;
  int max_sink = 4;
  int budget = 16;
  int length = 200;  // tokens of every sequence's paged KV
  int steps = 60;
};

// The next selected positions of one (sequence, KV head) in [sink, length): most of `previous`
// stays, some leave, fresh ones enter, the size wanders in [0, budget].
std::vector<int32_t> NextSelected(std::mt19937_64& rng, const std::vector<int32_t>& previous,
                                  int sink, int length, int budget) {
  std::set<int32_t> chosen;
  for (const int32_t p : previous) {
    if (p >= sink && rng() % 6 != 0) chosen.insert(p);
  }
  const int room = length - sink;
  const int target = std::min(room, static_cast<int>(rng() % static_cast<uint64_t>(budget + 1)));
  while (static_cast<int>(chosen.size()) > target) {
    auto it = chosen.begin();
    std::advance(it, rng() % chosen.size());
    chosen.erase(it);
  }
  while (static_cast<int>(chosen.size()) < target) {
    chosen.insert(sink + static_cast<int32_t>(rng() % static_cast<uint64_t>(room)));
  }
  return {chosen.begin(), chosen.end()};
}

void RunCase(const DeltaCase& c) {
  SCOPED_TRACE("batch " + std::to_string(c.batch) + " heads " + std::to_string(c.heads) +
               " head_dim " + std::to_string(c.head_dim) + " sink " + std::to_string(c.max_sink) +
               " budget " + std::to_string(c.budget));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int batch = c.batch, heads = c.heads, head_dim = c.head_dim;
  const int capacity = c.max_sink + c.budget;
  const int stride = (c.length + c.block_tokens - 1) / c.block_tokens;
  const int num_blocks = batch * stride + 2;
  std::vector<int32_t> physical(static_cast<size_t>(num_blocks));
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  std::vector<int32_t> tables(physical.begin(), physical.begin() + batch * stride);
  const size_t pool_elements = static_cast<size_t>(num_blocks) * heads * c.block_tokens * head_dim;
  const std::vector<float> keys = gpu_test::RandomBf16Values(rng, pool_elements, -4.f, 4.f);
  const std::vector<float> values = gpu_test::RandomBf16Values(rng, pool_elements, -4.f, 4.f);
  // The K (or V) row of (sequence, head, position) in the paged pool.
  const auto row_of = [&](const std::vector<float>& pool, int b, int h, int32_t position) {
    const int64_t block = tables[static_cast<size_t>(b) * stride + position / c.block_tokens];
    const size_t at =
        ((static_cast<size_t>(block) * heads + h) * c.block_tokens + position % c.block_tokens) *
        head_dim;
    return std::vector<float>(pool.begin() + at, pool.begin() + at + head_dim);
  };
  auto d_keys = UploadBf16(keys);
  auto d_values = UploadBf16(values);
  auto d_tables = Upload(tables);

  // Maps and pools in shuffled slots of larger arrays (one spare).
  const int num_maps = batch + 1;
  std::vector<int32_t> map_index(static_cast<size_t>(num_maps));
  std::iota(map_index.begin(), map_index.end(), 0);
  std::shuffle(map_index.begin(), map_index.end(), rng);
  map_index.resize(static_cast<size_t>(batch));
  auto d_map_index = Upload(map_index);
  const size_t map_ints = static_cast<size_t>(num_maps) * heads * (1 + capacity);
  std::vector<int32_t> cpu_maps(map_ints, 0);
  auto d_maps = Upload(cpu_maps);
  const size_t pairs = static_cast<size_t>(batch) * heads;
  const size_t pool_rows = static_cast<size_t>(num_maps) * heads * capacity;
  auto d_pool_keys = Poisoned<__nv_bfloat16>(pool_rows * head_dim);
  auto d_pool_values = Poisoned<__nv_bfloat16>(pool_rows * head_dim);
  auto d_pool_counts = Poisoned<int32_t>(static_cast<size_t>(num_maps) * heads);
  auto d_pool_positions = Poisoned<int32_t>(pool_rows);
  std::vector<CompactPool> cpu_pools(static_cast<size_t>(batch),
                                     CompactPool(heads, capacity, head_dim));
  auto d_zero_sink = Upload(std::vector<int32_t>(static_cast<size_t>(batch), 0));

  std::vector<std::vector<int32_t>> previous(pairs);
  size_t entering_rows = 0, selected_rows = 0;
  for (int step = 0; step < c.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<int32_t> sink_end(static_cast<size_t>(batch)), reset(sink_end.size());
    std::vector<int32_t> selected(pairs * c.budget, INT32_MAX), selected_count(pairs);
    for (int b = 0; b < batch; ++b) {
      sink_end[b] = std::min(c.max_sink, step + b);
      reset[b] = step == 0 || rng() % 25 == 0 ? 1 : 0;
      for (int h = 0; h < heads; ++h) {
        const size_t pair = static_cast<size_t>(b) * heads + h;
        previous[pair] = NextSelected(rng, previous[pair], sink_end[b], c.length, c.budget);
        selected_count[pair] = static_cast<int32_t>(previous[pair].size());
        std::copy(previous[pair].begin(), previous[pair].end(), selected.begin() + pair * c.budget);
        selected_rows += sink_end[b] + previous[pair].size();
      }
    }
    auto d_sink = Upload(sink_end);
    auto d_reset = Upload(reset);
    auto d_selected = Upload(selected);
    auto d_selected_count = Upload(selected_count);
    auto d_counts = Poisoned<int32_t>(pairs);
    auto d_entering = Poisoned<int32_t>(pairs);
    auto d_slots = Poisoned<int32_t>(pairs * capacity);
    auto d_positions = Poisoned<int32_t>(pairs * capacity);

    // 1. The slot update, GPU and CPU.
    CompactSlotUpdateParams u;
    u.maps = d_maps.data();
    u.num_maps = num_maps;
    u.map_index = d_map_index.data();
    u.reset = d_reset.data();
    u.sink_end = d_sink.data();
    u.max_sink_tokens = c.max_sink;
    u.selected = d_selected.data();
    u.selected_count = d_selected_count.data();
    u.budget = c.budget;
    u.batch = batch;
    u.num_kv_heads = heads;
    u.capacity = capacity;
    u.counts = d_counts.data();
    u.entering = d_entering.data();
    u.entering_slots = d_slots.data();
    u.entering_positions = d_positions.data();
    ASSERT_TRUE(CompactSlotUpdate(u, nullptr).ok());
    std::vector<int32_t> counts(pairs), entering(pairs), slots(pairs * capacity),
        positions(pairs * capacity);
    CompactSlotUpdateArgs a;
    a.maps = cpu_maps.data();
    a.num_maps = num_maps;
    a.map_index = map_index.data();
    a.reset = reset.data();
    a.sink_end = sink_end.data();
    a.max_sink_tokens = c.max_sink;
    a.selected = selected.data();
    a.selected_count = selected_count.data();
    a.budget = c.budget;
    a.batch = batch;
    a.num_kv_heads = heads;
    a.capacity = capacity;
    a.counts = counts.data();
    a.entering = entering.data();
    a.entering_slots = slots.data();
    a.entering_positions = positions.data();
    const Status cpu = ::rubato::CompactSlotUpdate(a);
    ASSERT_TRUE(cpu.ok()) << cpu.message();
    ASSERT_EQ(Download(d_counts), counts);
    ASSERT_EQ(Download(d_entering), entering);
    ASSERT_EQ(Download(d_slots), slots);
    ASSERT_EQ(Download(d_positions), positions);
    // Map entries in use must agree; those past a count are unspecified.
    const std::vector<int32_t> gpu_maps = Download(d_maps);
    for (size_t m = 0; m < static_cast<size_t>(num_maps) * heads; ++m) {
      const int32_t* want = cpu_maps.data() + m * (1 + capacity);
      const int32_t* got = gpu_maps.data() + m * (1 + capacity);
      ASSERT_EQ(got[0], want[0]) << "map " << m;
      for (int s = 0; s < want[0]; ++s) ASSERT_EQ(got[1 + s], want[1 + s]) << "map " << m;
    }

    // 2. The delta pack's rows: compact gather of the entering positions.
    auto d_pack_keys = Poisoned<__nv_bfloat16>(pairs * capacity * head_dim);
    auto d_pack_values = Poisoned<__nv_bfloat16>(pairs * capacity * head_dim);
    auto d_gathered = Poisoned<int32_t>(pairs);
    CompactGatherParams g;
    g.key_pool = d_keys.data();
    g.value_pool = d_values.data();
    g.num_pool_blocks = num_blocks;
    g.block_tables = d_tables.data();
    g.block_table_stride = stride;
    g.sink_end = d_zero_sink.data();
    g.max_sink_tokens = 0;
    g.selected = d_positions.data();
    g.selected_count = d_entering.data();
    g.budget = capacity;
    g.batch = batch;
    g.num_kv_heads = heads;
    g.head_dim = head_dim;
    g.block_tokens = c.block_tokens;
    g.compact_keys = d_pack_keys.data();
    g.compact_values = d_pack_values.data();
    g.compact_capacity = capacity;
    g.compact_counts = d_gathered.data();
    ASSERT_TRUE(GatherCompactKv(g, nullptr).ok());
    const std::vector<float> pack_keys = gpu_test::DownloadBf16(d_pack_keys);
    const std::vector<float> pack_values = gpu_test::DownloadBf16(d_pack_values);
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < heads; ++h) {
        const size_t pair = static_cast<size_t>(b) * heads + h;
        entering_rows += static_cast<size_t>(entering[pair]);
        for (int r = 0; r < entering[pair]; ++r) {
          const size_t at = (pair * capacity + r) * head_dim;
          const auto k = row_of(keys, b, h, positions[pair * capacity + r]);
          const auto v = row_of(values, b, h, positions[pair * capacity + r]);
          ASSERT_TRUE(std::equal(k.begin(), k.end(), pack_keys.begin() + at))
              << "pack key row " << r << " of sequence " << b << " head " << h;
          ASSERT_TRUE(std::equal(v.begin(), v.end(), pack_values.begin() + at))
              << "pack value row " << r << " of sequence " << b << " head " << h;
        }
      }
    }

    // 3. The inference rank's pools: the GPU scatter against CompactPool::Apply.
    CompactDeltaScatterParams s;
    s.counts = d_counts.data();
    s.slots = d_slots.data();
    s.positions = d_positions.data();
    s.keys = d_pack_keys.data();
    s.values = d_pack_values.data();
    s.rows = capacity;
    s.batch = batch;
    s.num_kv_heads = heads;
    s.head_dim = head_dim;
    s.pool_index = d_map_index.data();
    s.num_pools = num_maps;
    s.capacity = capacity;
    s.pool_keys = d_pool_keys.data();
    s.pool_values = d_pool_values.data();
    s.pool_counts = d_pool_counts.data();
    s.pool_positions = d_pool_positions.data();
    ASSERT_TRUE(ScatterCompactDelta(s, nullptr).ok());
    const std::vector<float> got_keys = gpu_test::DownloadBf16(d_pool_keys);
    const std::vector<float> got_values = gpu_test::DownloadBf16(d_pool_values);
    const std::vector<int32_t> got_counts = Download(d_pool_counts);
    const std::vector<int32_t> got_positions = Download(d_pool_positions);
    for (int b = 0; b < batch; ++b) {
      CompactPool& pool = cpu_pools[static_cast<size_t>(b)];
      for (int h = 0; h < heads; ++h) {
        const size_t pair = static_cast<size_t>(b) * heads + h;
        const size_t rows = static_cast<size_t>(entering[pair]);
        const size_t at = pair * capacity * head_dim;
        const Status applied =
            pool.Apply(h, reset[b] != 0, counts[pair],
                       std::span<const int32_t>(slots.data() + pair * capacity, rows),
                       std::span<const int32_t>(positions.data() + pair * capacity, rows),
                       std::span<const float>(pack_keys.data() + at, rows * head_dim),
                       std::span<const float>(pack_values.data() + at, rows * head_dim));
        ASSERT_TRUE(applied.ok()) << applied.message();
        const size_t pool_pair = static_cast<size_t>(map_index[b]) * heads + h;
        ASSERT_EQ(got_counts[pool_pair], pool.counts()[h]);
        const std::span<const int32_t> want_positions = pool.positions(h);
        for (int slot = 0; slot < capacity; ++slot) {
          const bool used = slot < pool.counts()[h];
          ASSERT_EQ(got_positions[pool_pair * capacity + slot], used ? want_positions[slot] : -1)
              << "slot " << slot << " of sequence " << b << " head " << h;
          if (!used) continue;
          const size_t want_at = (static_cast<size_t>(h) * capacity + slot) * head_dim;
          const size_t got_at = (pool_pair * capacity + slot) * head_dim;
          ASSERT_TRUE(std::equal(pool.keys() + want_at, pool.keys() + want_at + head_dim,
                                 got_keys.begin() + got_at))
              << "pool key slot " << slot << " of sequence " << b << " head " << h;
          ASSERT_TRUE(std::equal(pool.values() + want_at, pool.values() + want_at + head_dim,
                                 got_values.begin() + got_at))
              << "pool value slot " << slot << " of sequence " << b << " head " << h;
        }
      }
    }
  }
  std::cout << "[ deltas    ] " << entering_rows << " rows entered of " << selected_rows
            << " selected (" << 100.0 * entering_rows / std::max<size_t>(selected_rows, 1)
            << " %)\n";
  EXPECT_LT(entering_rows, selected_rows);
}

TEST(CompactDeltaOpTest, SmallShapesOverManySteps) {
  RunCase({.batch = 3,
           .heads = 2,
           .head_dim = 16,
           .block_tokens = 16,
           .max_sink = 4,
           .budget = 16,
           .length = 80,
           .steps = 200});
}

TEST(CompactDeltaOpTest, NoSinkEightHeads) {
  RunCase({.batch = 2,
           .heads = 8,
           .head_dim = 128,
           .block_tokens = 64,
           .max_sink = 0,
           .budget = 300,
           .length = 1000,
           .steps = 40});
}

TEST(CompactDeltaOpTest, QwenShapesBudget2048) {
  // More than one block-wide scan tile per map (capacity 2052 > 256 threads).
  RunCase({.batch = 2,
           .heads = 8,
           .head_dim = 128,
           .block_tokens = 64,
           .max_sink = 4,
           .budget = 2048,
           .length = 6000,
           .steps = 12});
}

TEST(CompactDeltaOpTest, RefusesBadShapesByName) {
  CompactSlotUpdateParams u;
  u.batch = 1;
  u.num_kv_heads = 1;
  u.budget = 16;
  u.capacity = 8;
  EXPECT_TRUE(gpu_test::FailsWith(CompactSlotUpdate(u, nullptr), StatusCode::kInvalidArgument,
                                  "capacity = 8"));
  u.capacity = kMaxCompactSlots + 1;
  EXPECT_TRUE(
      gpu_test::FailsWith(CompactSlotUpdate(u, nullptr), StatusCode::kInvalidArgument, "capacity"));
  CompactDeltaScatterParams s;
  s.batch = 1;
  s.num_kv_heads = 1;
  s.head_dim = 12;
  s.capacity = 4;
  EXPECT_TRUE(gpu_test::FailsWith(ScatterCompactDelta(s, nullptr), StatusCode::kInvalidArgument,
                                  "head_dim = 12"));
}

}  // namespace
}  // namespace rubato::cuda
