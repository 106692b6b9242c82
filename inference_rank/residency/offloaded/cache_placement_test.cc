// PickCacheRank: the most free budget wins, ties go to the lower index, lost ranks take nothing,
// for any number of ranks.
#include "inference_rank/residency/offloaded/cache_placement.h"

#include <gtest/gtest.h>

#include <vector>

namespace rubato {
namespace {

TEST(CachePlacementTest, TheMostFreeBudgetWins) {
  const std::vector<CacheRankBudget> ranks = {{true, 100}, {true, 300}, {true, 200}};
  EXPECT_EQ(PickCacheRank(ranks), 1);
}

TEST(CachePlacementTest, TiesGoToTheLowerIndex) {
  const std::vector<CacheRankBudget> ranks = {{true, 50}, {true, 300}, {true, 300}, {true, 300}};
  EXPECT_EQ(PickCacheRank(ranks), 1);
  const std::vector<CacheRankBudget> equal = {{true, 7}, {true, 7}, {true, 7}};
  EXPECT_EQ(PickCacheRank(equal), 0);
}

TEST(CachePlacementTest, ALostRankTakesNothing) {
  const std::vector<CacheRankBudget> ranks = {{true, 100}, {false, 900}, {true, 200}};
  EXPECT_EQ(PickCacheRank(ranks), 2);
  const std::vector<CacheRankBudget> none = {{false, 100}, {false, 200}};
  EXPECT_EQ(PickCacheRank(none), -1);
  EXPECT_EQ(PickCacheRank({}), -1);
}

// Requests placed one after another, each reserving what it takes: N requests over M ranks of
// equal budgets spread round-robin; an emptier rank takes requests until it is level.
TEST(CachePlacementTest, SuccessivePlacementsSpreadByFreeBudget) {
  for (int m = 1; m <= 5; ++m) {
    std::vector<CacheRankBudget> ranks(static_cast<size_t>(m), CacheRankBudget{true, 1000});
    std::vector<int> placed;
    for (int request = 0; request < 3 * m; ++request) {
      const int rank = PickCacheRank(ranks);
      ASSERT_GE(rank, 0);
      placed.push_back(rank);
      ranks[static_cast<size_t>(rank)].bytes_free -= 10;
    }
    for (int request = 0; request < 3 * m; ++request) EXPECT_EQ(placed[request], request % m);
  }
  std::vector<CacheRankBudget> ranks = {{true, 100}, {true, 130}, {true, 100}};
  std::vector<int> placed;
  for (int request = 0; request < 5; ++request) {
    const int rank = PickCacheRank(ranks);
    placed.push_back(rank);
    ranks[static_cast<size_t>(rank)].bytes_free -= 10;
  }
  EXPECT_EQ(placed, (std::vector<int>{1, 1, 1, 0, 1}));
}

}  // namespace
}  // namespace rubato
