// Tests for the SnapKV-style prompt scoring (snapkv_scores.h): pooled scores against a
// double-precision reference over odd lengths, windows, pooling kernels and GQA groups, on a
// paged view with scattered blocks; the kept positions (sinks, top scores with ties to the lower
// position, window); refused input.
#include "kernels/cpu/snapkv_scores.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/all_close_for_test.h"

namespace rubato {
namespace {

struct Case {
  int heads, kv_heads, head_dim, length, window, kernel;
};

// Keys in blocks of 16 placed in reverse physical order, random queries.
struct Fixture {
  Case c;
  std::vector<float> keys, queries;
  std::vector<int32_t> table;
  PagedKvView view;

  Fixture(const Case& cs, uint32_t seed) : c(cs) {
    const int blocks = (c.length + 15) / 16;
    for (int b = 0; b < blocks; ++b) table.push_back(blocks - 1 - b);
    keys.resize(size_t(blocks) * c.kv_heads * 16 * c.head_dim);
    queries.resize(size_t(c.window) * c.heads * c.head_dim);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (float& x : keys) x = normal(rng);
    for (float& x : queries) x = 1.5f * normal(rng);
    view = PagedKvView{keys.data(), keys.data(), table.data(), 16, c.kv_heads, c.head_dim};
  }

  std::vector<double> Reference() const {
    const int group = c.heads / c.kv_heads, d = c.head_dim, prefix = c.length - c.window;
    std::vector<double> out(size_t(c.kv_heads) * prefix);
    for (int h = 0; h < c.kv_heads; ++h) {
      std::vector<double> summed(prefix, 0.0);
      for (int w = 0; w < c.window; ++w) {
        const int n = prefix + w + 1;
        for (int g = 0; g < group; ++g) {
          const float* q = queries.data() + (size_t(w) * c.heads + h * group + g) * d;
          std::vector<double> s(n);
          for (int p = 0; p < n; ++p) {
            double dot = 0;
            for (int e = 0; e < d; ++e) dot += double(q[e]) * keys[view.Offset(p, h) + e];
            s[p] = dot / std::sqrt(double(d));
          }
          const double max = *std::max_element(s.begin(), s.end());
          double sum = 0;
          for (double x : s) sum += std::exp(x - max);
          for (int p = 0; p < prefix; ++p) summed[p] += std::exp(s[p] - max) / sum;
        }
      }
      for (int p = 0; p < prefix; ++p) {
        double best = 0;
        for (int i = std::max(0, p - c.kernel / 2); i <= std::min(prefix - 1, p + c.kernel / 2);
             ++i) {
          best = std::max(best, summed[i]);
        }
        out[size_t(h) * prefix + p] = best;
      }
    }
    return out;
  }
};

TEST(SnapKvScores, MatchesDoubleReference) {
  const Case cases[] = {{4, 4, 16, 37, 8, 7},
                        {8, 2, 32, 100, 32, 7},
                        {8, 1, 16, 65, 1, 1},
                        {4, 1, 64, 130, 32, 3},
                        {16, 2, 16, 48, 47, 7}};
  uint32_t seed = 1;
  for (const Case& c : cases) {
    Fixture f(c, seed++);
    std::vector<float> scores(size_t(c.kv_heads) * (c.length - c.window), -1.f);
    SnapKvScoreArgs args{f.queries.data(), c.window, c.heads,      f.view,
                         c.length,         c.kernel, scores.data()};
    std::vector<float> scratch(static_cast<size_t>(SnapKvScoresScratchSize(args)));
    ASSERT_TRUE(SnapKvScores(args, scratch).ok());
    const std::vector<double> ref = f.Reference();
    EXPECT_TRUE(AllClose<double>("length " + std::to_string(c.length), scores, ref, 1e-6, 1e-4));
  }
}

TEST(SnapKvScores, KeepsSinksTopScoresAndWindow) {
  // length 20, window 4, sinks 2, budget 10: 4 chosen among positions [2, 16).
  std::vector<float> scores(16, 0.1f);
  scores[0] = 9.f;  // a sink: kept anyway, never counted among the chosen
  scores[5] = 0.9f;
  scores[12] = 0.8f;
  scores[7] = 0.5f;
  scores[9] = 0.5f;  // ties 0.5 with 7 and 14: the lower positions win
  scores[14] = 0.5f;
  std::vector<int> kept;
  SnapKvKeep(scores.data(), 20, 4, 2, 10, kept);
  EXPECT_EQ(kept, (std::vector<int>{0, 1, 5, 7, 9, 12, 16, 17, 18, 19}));
  // Every score equal: the lowest prefix positions.
  std::vector<float> flat(16, 1.f);
  SnapKvKeep(flat.data(), 20, 4, 0, 8, kept);
  EXPECT_EQ(kept, (std::vector<int>{0, 1, 2, 3, 16, 17, 18, 19}));
}

TEST(SnapKvScores, RefusesBadShapes) {
  Fixture f({4, 2, 16, 40, 8, 7}, 3);
  std::vector<float> scores(2 * 32);
  std::vector<float> scratch(100);
  SnapKvScoreArgs args{f.queries.data(), 8, 4, f.view, 40, 7, scores.data()};
  args.pool_kernel = 6;
  EXPECT_NE(SnapKvScores(args, scratch).message().find("pool_kernel 6"), std::string::npos);
  args.pool_kernel = 7;
  args.window = 40;
  EXPECT_NE(SnapKvScores(args, scratch).message().find("window 40"), std::string::npos);
  args.window = 8;
  args.num_heads = 3;
  EXPECT_NE(SnapKvScores(args, scratch).message().find("num_heads 3"), std::string::npos);
  args.num_heads = 4;
  std::vector<float> small(10);
  EXPECT_NE(SnapKvScores(args, small).message().find("scratch"), std::string::npos);
}

}  // namespace
}  // namespace rubato
