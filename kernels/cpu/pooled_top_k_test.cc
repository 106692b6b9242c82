// Tests for the pooled top-k CPU op: random scores against a brute-force double-precision
// transcription of the contract written here (softmax per head, mean over the group, full sort),
// for groups of 1 to 8 query heads and both score units; plus hand-built cases whose answer is
// known without any reference: ties, k >= n, non-finite scores, and the input checks.
#include "kernels/cpu/pooled_top_k.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace rubato {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Owns the scores a PooledTopKInput points to: [group][stride], candidates in [0, count).
struct Case {
  int group = 1;
  int count = 0;
  int begin = 0;
  int64_t stride = 0;
  ScoreUnits units = ScoreUnits::kNatural;
  std::vector<float> scores;

  PooledTopKInput Input() const {
    return {scores.empty() ? nullptr : scores.data(), stride, group, count, begin, units};
  }
  float& Score(int q, int i) { return scores[static_cast<size_t>(q * stride + i)]; }
};

Case RandomCase(std::mt19937_64& rng, int group, int count, ScoreUnits units) {
  Case c;
  c.group = group;
  c.count = count;
  c.begin = static_cast<int>(rng() % 1000);
  c.stride = count + static_cast<int64_t>(rng() % 5);
  c.units = units;
  // Padding past count holds NaN: the op must not read it.
  c.scores.assign(static_cast<size_t>(group * c.stride), kNaN);
  std::uniform_real_distribution<float> dist(-8.f, 8.f);
  for (int q = 0; q < group; ++q) {
    for (int i = 0; i < count; ++i) c.Score(q, i) = dist(rng);
  }
  return c;
}

// The contract in double: softmax per head (non-finite -> -inf, a head of -inf only adds 0),
// mean over the group.
std::vector<double> ReferencePooled(const Case& c) {
  std::vector<double> pooled(static_cast<size_t>(c.count), 0.0);
  std::vector<double> probs(static_cast<size_t>(c.count));
  for (int q = 0; q < c.group; ++q) {
    double max_score = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < c.count; ++i) {
      const float s = c.scores[static_cast<size_t>(q * c.stride + i)];
      probs[i] = std::isfinite(s) ? s : -std::numeric_limits<double>::infinity();
      max_score = std::max(max_score, probs[i]);
    }
    if (std::isinf(max_score)) continue;
    double sum = 0.0;
    for (double& p : probs) {
      p = c.units == ScoreUnits::kLog2 ? std::exp2(p - max_score) : std::exp(p - max_score);
      sum += p;
    }
    for (int i = 0; i < c.count; ++i) pooled[i] += probs[i] / sum / c.group;
  }
  return pooled;
}

// The min(k, n) best by (score descending, index ascending), as ascending positions.
std::vector<int> ReferenceTopK(const std::vector<double>& pooled, int k, int begin) {
  std::vector<int> order(pooled.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return pooled[a] != pooled[b] ? pooled[a] > pooled[b] : a < b; });
  order.resize(std::min(order.size(), static_cast<size_t>(k)));
  std::sort(order.begin(), order.end());
  for (int& i : order) i += begin;
  return order;
}

// True when f32 rounding (far below `rel`) cannot change which k candidates are kept: scores
// below the cut lie more than rel * cut under it and, when the cut splits a group of equal scores,
// scores above it lie more than rel * cut over it. Exactly equal scores come from equal inputs
// and stay equal in any precision.
bool CutIsSeparated(const std::vector<double>& pooled, int k, double rel) {
  if (k == 0 || k >= static_cast<int>(pooled.size())) return true;
  std::vector<double> sorted = pooled;
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  const double cut = sorted[k - 1], tol = rel * cut;
  const auto below =
      std::find_if(sorted.begin() + k, sorted.end(), [&](double s) { return s < cut; });
  if (below != sorted.end() && cut - *below <= tol) return false;
  if (sorted[k] == cut) {  // the cut splits a tie: nothing above may come near it either
    const auto above = std::find_if(sorted.rbegin() + (sorted.size() - k), sorted.rend(),
                                    [&](double s) { return s > cut; });
    if (above != sorted.rend() && *above - cut <= tol) return false;
  }
  return true;
}

std::vector<int> Select(const Case& c, int k) {
  std::vector<int> positions = {-7};  // replaced on success
  const Status status = PooledTopK(c.Input(), k, positions);
  EXPECT_TRUE(status.ok()) << status.message();
  return positions;
}

std::string Describe(const Case& c, int k) {
  return "group " + std::to_string(c.group) + " count " + std::to_string(c.count) + " k " +
         std::to_string(k) + " begin " + std::to_string(c.begin) +
         (c.units == ScoreUnits::kLog2 ? " log2" : " natural");
}

TEST(PooledTopK, MatchesDoubleReference) {
  std::mt19937_64 rng(20240611);
  for (ScoreUnits units : {ScoreUnits::kNatural, ScoreUnits::kLog2}) {
    for (int group : {1, 2, 4, 8}) {
      for (int count : {1, 2, 7, 100, 1000, 5000}) {
        for (int k : {1, 3, count / 2, count - 1}) {
          if (k < 1 || k >= count) continue;
          Case c = RandomCase(rng, group, count, units);
          std::vector<double> pooled = ReferencePooled(c);
          for (int attempt = 0; !CutIsSeparated(pooled, k, 1e-4); ++attempt) {
            ASSERT_LT(attempt, 50) << "no well-separated input drawn";
            c = RandomCase(rng, group, count, units);
            pooled = ReferencePooled(c);
          }
          SCOPED_TRACE(Describe(c, k));
          const std::vector<int> got = Select(c, k);
          ASSERT_EQ(got, ReferenceTopK(pooled, k, c.begin));
        }
      }
    }
  }
}

TEST(PooledTopK, TiesGoToTheLowerPosition) {
  // All candidates equal: the first k.
  Case flat;
  flat.group = 4;
  flat.count = 50;
  flat.begin = 10;
  flat.stride = 50;
  flat.scores.assign(4 * 50, 1.5f);
  EXPECT_EQ(Select(flat, 3), (std::vector<int>{10, 11, 12}));

  // Scores from {0, 1, 2, 3}, the same for every head of a candidate: equal candidates tie
  // exactly, and the cut falls inside a group of ties.
  std::mt19937_64 rng(7);
  for (ScoreUnits units : {ScoreUnits::kNatural, ScoreUnits::kLog2}) {
    for (int group : {1, 2, 4, 8}) {
      Case c = RandomCase(rng, group, 300, units);
      for (int i = 0; i < c.count; ++i) {
        const float level = static_cast<float>(rng() % 4);
        for (int q = 0; q < group; ++q) c.Score(q, i) = level;
      }
      const std::vector<double> pooled = ReferencePooled(c);
      for (int k : {1, 40, 150, 299}) {
        SCOPED_TRACE(Describe(c, k));
        ASSERT_TRUE(CutIsSeparated(pooled, k, 1e-4));
        ASSERT_EQ(Select(c, k), ReferenceTopK(pooled, k, c.begin));
      }
    }
  }
}

TEST(PooledTopK, KAtLeastCountKeepsEveryCandidate) {
  Case c;
  c.group = 2;
  c.count = 5;
  c.begin = 100;
  c.stride = 5;
  c.scores.assign(10, kNaN);  // never read
  const std::vector<int> all = {100, 101, 102, 103, 104};
  EXPECT_EQ(Select(c, 5), all);
  EXPECT_EQ(Select(c, 1000), all);

  Case empty;  // no candidates, no scores
  empty.begin = 3;
  EXPECT_EQ(Select(empty, 0), std::vector<int>{});
  EXPECT_EQ(Select(empty, 4), std::vector<int>{});
  std::mt19937_64 rng(11);
  EXPECT_EQ(Select(RandomCase(rng, 4, 20, ScoreUnits::kLog2), 0), std::vector<int>{});
}

TEST(PooledTopK, NonFiniteScoresCountAsMinusInfinity) {
  std::mt19937_64 rng(5);
  for (ScoreUnits units : {ScoreUnits::kNatural, ScoreUnits::kLog2}) {
    for (int group : {1, 2, 4, 8}) {
      Case c = RandomCase(rng, group, 400, units);
      const float non_finite[] = {kNaN, kInf, -kInf};
      for (int q = 0; q < group; ++q) {
        for (int i = 0; i < c.count; ++i) {
          if (rng() % 5 == 0) c.Score(q, i) = non_finite[rng() % 3];
        }
      }
      for (int i = 0; i < 30; ++i) {  // candidates with no finite score at all
        for (int q = 0; q < group; ++q) c.Score(q, 300 + i) = non_finite[rng() % 3];
      }
      const std::vector<double> pooled = ReferencePooled(c);
      for (int k : {1, 17, 200, 380}) {
        if (!CutIsSeparated(pooled, k, 1e-4)) continue;  // a near tie: nothing to learn here
        SCOPED_TRACE(Describe(c, k));
        const std::vector<int> got = Select(c, k);
        ASSERT_EQ(got, ReferenceTopK(pooled, k, c.begin));
        // Candidates with no finite score come after all others, lower positions first.
        std::vector<int> finite, none;
        for (int i = 0; i < c.count; ++i) {
          bool any = false;
          for (int q = 0; q < group; ++q) any = any || std::isfinite(c.Score(q, i));
          (any ? finite : none).push_back(c.begin + i);
        }
        const int none_kept = std::max(0, k - static_cast<int>(finite.size()));
        for (size_t i = 0; i < none.size(); ++i) {
          const bool kept = std::binary_search(got.begin(), got.end(), none[i]);
          EXPECT_EQ(kept, static_cast<int>(i) < none_kept) << "position " << none[i];
        }
      }
    }
  }
}

TEST(PooledTopK, HeadWithoutFiniteScoresContributesNothing) {
  // Head 0 has no finite score; head 1 alone decides: its k highest raw scores.
  Case c;
  c.group = 2;
  c.count = 6;
  c.begin = 20;
  c.stride = 8;
  c.units = ScoreUnits::kLog2;
  c.scores.assign(16, -kInf);
  c.Score(0, 2) = kNaN;
  const float head1[] = {0.5f, 3.f, -1.f, 2.f, 7.f, 1.f};
  for (int i = 0; i < 6; ++i) c.Score(1, i) = head1[i];
  EXPECT_EQ(Select(c, 3), (std::vector<int>{21, 23, 24}));
  EXPECT_EQ(Select(c, 1), (std::vector<int>{24}));
}

TEST(PooledTopK, BadInputsAreInvalidArgumentNamingTheField) {
  std::mt19937_64 rng(3);
  const Case good = RandomCase(rng, 2, 10, ScoreUnits::kNatural);
  struct Bad {
    const char* field;
    void (*change)(PooledTopKInput&, int&);
  };
  const Bad bad[] = {
      {"group", [](PooledTopKInput& in, int&) { in.group = 0; }},
      {"count", [](PooledTopKInput& in, int&) { in.count = -1; }},
      {"begin = -2", [](PooledTopKInput& in, int&) { in.begin = -2; }},
      {"begin + count", [](PooledTopKInput& in, int&) { in.begin = INT32_MAX - 5; }},
      {"stride", [](PooledTopKInput& in, int&) { in.stride = 9; }},
      {"k = -1", [](PooledTopKInput&, int& k) { k = -1; }},
      {"scores is null", [](PooledTopKInput& in, int&) { in.scores = nullptr; }},
  };
  for (const Bad& b : bad) {
    PooledTopKInput in = good.Input();
    int k = 3;
    b.change(in, k);
    std::vector<int> positions = {42};
    const Status status = PooledTopK(in, k, positions);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << b.field;
    EXPECT_NE(status.message().find(b.field), std::string::npos) << status.message();
    EXPECT_EQ(positions, std::vector<int>{42}) << b.field << ": output touched";
  }
}

}  // namespace
}  // namespace rubato
