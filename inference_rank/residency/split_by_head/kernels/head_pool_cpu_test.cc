// The device pool's bookkeeping on the CPU (the twin the GPU ops are held to): an install puts
// the static set first; an anticipation keeps the rows selected again where they are, gives
// the freed rows to the new positions (only those move: the delta), appends the rest, and never
// leaves a hole.
#include "inference_rank/residency/split_by_head/kernels/head_pool_cpu.h"

#include <gtest/gtest.h>

#include <vector>

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

}  // namespace
}  // namespace rubato
