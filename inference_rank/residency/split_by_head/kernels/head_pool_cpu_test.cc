// The device pool's bookkeeping on the CPU (the twin the GPU ops are held to): an install puts
// the static set first; an anticipation keeps the rows selected again where they are, gives
// the freed rows to the new positions (only those move: the delta), appends the rest, and never
// leaves a hole.
#include "inference_rank/residency/split_by_head/kernels/head_pool_cpu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "inference_rank/residency/split_by_head/split_by_head_kv.h"

namespace rubato {
namespace {

struct Book {
  std::vector<int32_t> positions = std::vector<int32_t>(8, 0);
  std::vector<int32_t> row_of = std::vector<int32_t>(32, 7);  // garbage an install clears
  std::vector<int32_t> sizes = {0, 0};
  HeadPoolBookRow Row() { return {positions.data(), row_of.data(), sizes.data(), 8, 32}; }
  std::vector<int32_t> Held() const {
    return std::vector<int32_t>(positions.begin(), positions.begin() + sizes[0] + sizes[1]);
  }
};

TEST(HeadPoolCpu, InstallThenAnticipationsMoveOnlyTheDelta) {
  Book book;
  HeadPoolMoves moves = HeadPoolInstallCpu(book.Row(), {2, 9}, {4, 5, 11});
  EXPECT_EQ(book.Held(), (std::vector<int32_t>{2, 9, 4, 5, 11}));
  EXPECT_EQ(moves.rows, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(book.row_of[9], 1);
  EXPECT_EQ(book.row_of[0], -1);

  // {5, 11} stay; 4 is freed (row 2) and taken by 13; 20 and 21 are appended.
  moves = HeadPoolAnticipateCpu(book.Row(), {5, 11, 13, 20, 21});
  EXPECT_EQ(moves.positions, (std::vector<int32_t>{13, 20, 21}));
  EXPECT_EQ(moves.rows, (std::vector<int32_t>{2, 5, 6}));
  EXPECT_EQ(book.Held(), (std::vector<int32_t>{2, 9, 13, 5, 11, 20, 21}));
  EXPECT_EQ(book.row_of[4], -1);
  EXPECT_EQ(book.row_of[21], 6);
  EXPECT_EQ(book.sizes[1], 5);

  // Nothing new: nothing moves.
  moves = HeadPoolAnticipateCpu(book.Row(), {5, 11, 13, 20, 21});
  EXPECT_TRUE(moves.rows.empty());
}

TEST(HeadPoolCpu, AShrinkingSetFreesOnlyAsManyRowsAsArrive) {
  Book book;
  HeadPoolInstallCpu(book.Row(), {0}, {3, 4, 5});
  // Two of three old rows unselected, one new position: one freed (the first), no hole.
  const HeadPoolMoves moves = HeadPoolAnticipateCpu(book.Row(), {5, 6});
  EXPECT_EQ(moves.rows, (std::vector<int32_t>{1}));
  EXPECT_EQ(book.Held(), (std::vector<int32_t>{0, 6, 4, 5}));
  EXPECT_EQ(book.sizes[1], 3);
}

TEST(HeadPoolCpu, CopiesOnlyTheMovesItIsGiven) {
  HeadPoolMoves moves;
  moves.rows = {1, 0, -1};
  moves.positions = {7, 3, 4};
  std::vector<uint16_t> source(10 * 2), pool(2 * 2, 0);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<uint16_t>(100 + i);
  const int copied = HeadPoolCopyCpu(
      moves, 2, [&](int p) { return source.data() + p * 2; }, [](int p) { return p > 5; },
      pool.data());
  EXPECT_EQ(copied, 1);
  EXPECT_EQ(pool, (std::vector<uint16_t>{0, 0, 114, 115}));
}

// The CUDA path's pool against the CPU engine's front (split_by_head_kv.h) under the same
// selections: after every swap the pool holds exactly the front's positions, and the rows it
// fetches from the store are the CPU half's fetched rows (the others are kept in place or copied
// from the recent positions).
TEST(HeadPoolCpu, HoldsTheCpuFrontAndFetchesTheSameDelta) {
  constexpr int kHeads = 2, kDim = 2, kCapacity = 128, kPool = 64;
  HeadSplit split;  // head 0 the R-head, head 1 its NR-head
  split.num_layers = 1;
  split.num_kv_heads = kHeads;
  split.cluster = {{0, 0}};
  split.representative = {{0}};
  std::unique_ptr<KvFetcher> fetcher = MakeDeferredKvFetcher();
  SplitByHeadCounters counters;
  SplitByHeadKv kv(split, kDim, kCapacity, *fetcher, counters);
  std::vector<float> keys(kHeads * kCapacity * kDim, 0.5f), values = keys;
  int32_t table[1] = {0};
  const PagedKvView paged{keys.data(), values.data(), table, kCapacity, kHeads, kDim};
  auto forward = [&](int start, int tokens) {
    std::vector<float> rows(static_cast<size_t>(tokens) * kHeads * kDim, 1.0f);
    ASSERT_TRUE(kv.Offload(0, rows.data(), rows.data(), start, tokens).ok());
  };
  Book book;
  book.positions.assign(kPool, 0);
  book.row_of.assign(kCapacity, -1);
  const HeadPoolBookRow row{book.positions.data(), book.row_of.data(), book.sizes.data(), kPool,
                            kCapacity};
  std::mt19937_64 rng(7);
  auto random_set = [&](int count, int range, const std::vector<int>& excluded) {
    std::vector<int> all;
    for (int p = 0; p < range; ++p) {
      if (!std::binary_search(excluded.begin(), excluded.end(), p)) all.push_back(p);
    }
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(static_cast<size_t>(count));
    std::sort(all.begin(), all.end());
    return all;
  };
  forward(0, 40);
  const std::vector<int> statics = random_set(5, 40, {});
  std::vector<int> dynamic = random_set(6, 40, statics);
  kv.SelectInitial(0, {statics}, {dynamic});
  ASSERT_TRUE(kv.ApplySelection(0, paged, 39).ok());
  HeadPoolInstallCpu(row, std::vector<int32_t>(statics.begin(), statics.end()),
                     std::vector<int32_t>(dynamic.begin(), dynamic.end()));
  int recent_begin = 40, size = 6;
  int64_t gpu_fetched = 0;
  for (int position = 40; position < 100; ++position) {
    ASSERT_TRUE(kv.BeginStep(0, position).ok());
    if (position % 3 == 0) {  // the step after an anticipation: the new sets are attended
      recent_begin = position;
      EXPECT_EQ(static_cast<int>(book.Held().size()), kv.Front(0).counts[1])
          << "position " << position;
    }
    forward(position, 1);
    if (position % 3 == 2) {  // an anticipation at this step
      size += static_cast<int>(rng() % 3);
      dynamic = random_set(size, position + 1, statics);
      kv.Anticipate(0, {dynamic});
      ASSERT_TRUE(kv.ApplySelection(0, paged, position).ok());
      const HeadPoolMoves moves =
          HeadPoolAnticipateCpu(row, std::vector<int32_t>(dynamic.begin(), dynamic.end()));
      for (int32_t p : moves.positions) gpu_fetched += p < recent_begin;
      std::vector<int32_t> held = book.Held();
      std::sort(held.begin(), held.end());
      std::vector<int32_t> expected(statics.begin(), statics.end());
      expected.insert(expected.end(), dynamic.begin(), dynamic.end());
      std::sort(expected.begin(), expected.end());
      EXPECT_EQ(held, expected) << "position " << position;
      EXPECT_EQ(gpu_fetched, counters.rows_fetched) << "position " << position;
    }
  }
  EXPECT_GT(counters.rows_fetched, 0);
}

}  // namespace
}  // namespace rubato
