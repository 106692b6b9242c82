// SplitStepByCache: each cache rank's rows in one staging block with its decode rows first, and
// gather / scatter indices that put every row back where the model has it.
#include "inference_rank/residency/offloaded/cache_step_split.h"

#include <gtest/gtest.h>

#include <random>

namespace rubato {
namespace {

CacheStepEntry Entry(int cache, uint64_t session, uint32_t position, uint32_t tokens = 1) {
  return {cache, {session, position, tokens}};
}

TEST(CacheStepSplitTest, InterleavedDecodeAndPrefillRowsStageByCache) {
  // Model rows: 0 (c1), 1 (c0), 2 (c1) decode; 3-5 prefill of c0; 6-7 prefill of c2.
  const CacheStepEntry entries[] = {Entry(1, 10, 100), Entry(0, 20, 50), Entry(1, 11, 7),
                                    Entry(0, 21, 0, 3), Entry(2, 30, 8, 2)};
  const Result<CacheStepSplit> split = SplitStepByCache(entries, 3, 3);
  ASSERT_TRUE(split.ok()) << split.status().message();
  ASSERT_EQ(split->parts.size(), 3u);
  const CacheStepPart& c0 = split->parts[0];
  const CacheStepPart& c1 = split->parts[1];
  const CacheStepPart& c2 = split->parts[2];
  EXPECT_EQ(c0.first_row, 0);
  EXPECT_EQ(c0.rows, 4);
  EXPECT_EQ(c0.decode_rows, 1);
  EXPECT_EQ(c1.first_row, 4);
  EXPECT_EQ(c1.rows, 2);
  EXPECT_EQ(c1.first_decode_row, 1);
  EXPECT_EQ(c1.decode_rows, 2);
  EXPECT_EQ(c2.first_row, 6);
  EXPECT_EQ(c2.decode_rows, 0);
  EXPECT_EQ(c2.first_decode_row, 3);
  ASSERT_EQ(c0.runs.size(), 2u);
  EXPECT_EQ(c0.runs[0].session_id, 20u);
  EXPECT_EQ(c0.runs[1].tokens, 3u);
  ASSERT_EQ(c1.runs.size(), 2u);
  EXPECT_EQ(c1.runs[1].first_position, 7u);
  EXPECT_EQ(split->gather, (std::vector<int32_t>{1, 3, 4, 5, 0, 2, 6, 7}));
  EXPECT_EQ(split->scatter, (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(split->shape, (std::vector<int64_t>{4, 1, 2, 2, 2, 0}));
}

TEST(CacheStepSplitTest, RandomStepsRoundTripEveryRow) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int caches = 1 + static_cast<int>(rng() % 5);
    const int decode = static_cast<int>(rng() % 9);
    std::vector<CacheStepEntry> entries;
    for (int d = 0; d < decode; ++d) entries.push_back(Entry(rng() % caches, d, 40 + d));
    const int prefills = static_cast<int>(rng() % 3);
    for (int p = 0; p < prefills; ++p) {
      entries.push_back(Entry(rng() % caches, 100 + p, 0, 1 + rng() % 6));
    }
    const Result<CacheStepSplit> split = SplitStepByCache(entries, decode, caches);
    ASSERT_TRUE(split.ok()) << split.status().message();
    // Model rows hold their own index; staging by gather, back by scatter.
    std::vector<int32_t> staged(split->gather.size());
    for (size_t s = 0; s < staged.size(); ++s) staged[s] = split->gather[s];
    std::vector<bool> seen(staged.size(), false);
    for (const int32_t row : staged) {
      ASSERT_GE(row, 0);
      ASSERT_LT(static_cast<size_t>(row), seen.size());
      EXPECT_FALSE(seen[static_cast<size_t>(row)]) << "row " << row << " staged twice";
      seen[static_cast<size_t>(row)] = true;
    }
    // Each part's block: its decode rows first, and its attention rows in the same order.
    for (int c = 0; c < caches; ++c) {
      const CacheStepPart& part = split->parts[static_cast<size_t>(c)];
      for (int r = 0; r < part.rows; ++r) {
        const int32_t model_row = staged[static_cast<size_t>(part.first_row + r)];
        EXPECT_EQ(model_row < decode, r < part.decode_rows) << "cache " << c << " row " << r;
        if (model_row < decode) {
          EXPECT_EQ(split->scatter[static_cast<size_t>(model_row)], part.first_decode_row + r);
        }
      }
    }
  }
}

TEST(CacheStepSplitTest, RefusesBadEntriesByName) {
  const CacheStepEntry outside[] = {Entry(3, 1, 0)};
  const Result<CacheStepSplit> a = SplitStepByCache(outside, 1, 3);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("cache rank 3 of 3"), std::string::npos);
  const CacheStepEntry wide_decode[] = {Entry(0, 1, 0, 2)};
  const Result<CacheStepSplit> b = SplitStepByCache(wide_decode, 1, 1);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("decode row"), std::string::npos);
  const CacheStepEntry one[] = {Entry(0, 1, 0)};
  EXPECT_FALSE(SplitStepByCache(one, 2, 1).ok());
  EXPECT_FALSE(SplitStepByCache(one, 1, 0).ok());
}

}  // namespace
}  // namespace rubato
