// Tests for LongFlow's fused attention and eviction choice (longflow_attention.h): output,
// slot scores and next slot against a double-precision reference (budgets not a multiple of a
// tile, masks with holes, GQA 1/4/8, sinks protected, ties to the lower slot), the overflow
// fallback (finite, equal to the max-subtracted reference), and refused input.
#include "kernels/cpu/longflow_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace rubato {
namespace {

struct Case {
  int heads, kv_heads, head_dim, budget, sink;
  double hole_share;  // share of slots left free
  float key_scale = 1.f;
};

struct Reference {
  std::vector<double> out, scores;
  std::vector<int> next;
};

Reference Compute(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                  const std::vector<float>& v, const std::vector<uint8_t>& valid) {
  const int group = c.heads / c.kv_heads, d = c.head_dim, B = c.budget;
  Reference r;
  r.out.assign(size_t(c.heads) * d, 0.0);
  r.scores.assign(size_t(c.kv_heads) * B, 0.0);
  for (int h = 0; h < c.kv_heads; ++h) {
    std::vector<double> alpha(B, 0.0);
    for (int g = 0; g < group; ++g) {
      const int head = h * group + g;
      std::vector<double> s(B, -INFINITY);
      double max = -INFINITY;
      for (int i = 0; i < B; ++i) {
        if (!valid[i]) continue;
        double dot = 0;
        for (int e = 0; e < d; ++e)
          dot += double(q[size_t(head) * d + e]) * k[(size_t(h) * B + i) * d + e];
        s[i] = dot / std::sqrt(double(d));
        max = std::max(max, s[i]);
      }
      double sum = 0;
      for (int i = 0; i < B; ++i) sum += valid[i] ? std::exp(s[i] - max) : 0.0;
      for (int i = 0; i < B; ++i) {
        if (!valid[i]) continue;
        // fp32 exp underflows to 0 below ~1.4e-45: such a slot has alpha 0 in the kernel too.
        const double weight = std::exp(s[i] - max);
        const double a = weight < 1.4e-45 ? 0.0 : weight / sum;
        alpha[i] += a / group;
        for (int e = 0; e < d; ++e)
          r.out[size_t(head) * d + e] += a * v[(size_t(h) * B + i) * d + e];
      }
    }
    int free_slot = -1, best = -1;
    for (int i = 0; i < B; ++i) {
      double norm = 0;
      for (int e = 0; e < d; ++e) norm += std::fabs(v[(size_t(h) * B + i) * d + e]);
      r.scores[size_t(h) * B + i] = valid[i] ? alpha[i] * norm : 0.0;
      if (!valid[i]) {
        if (free_slot < 0) free_slot = i;
      } else if (i >= c.sink &&
                 (best < 0 || r.scores[size_t(h) * B + i] < r.scores[size_t(h) * B + best])) {
        best = i;
      }
    }
    r.next.push_back(free_slot >= 0 ? free_slot : best);
  }
  return r;
}

void RunCase(const Case& c, uint64_t seed, bool tie = false) {
  SCOPED_TRACE("heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " budget " +
               std::to_string(c.budget) + " holes " + std::to_string(c.hole_share));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<double> unit(0, 1);
  std::vector<float> q(size_t(c.heads) * c.head_dim), k(size_t(c.kv_heads) * c.budget * c.head_dim),
      v(k.size());
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = c.key_scale * normal(rng);
  for (float& x : v) x = normal(rng);
  std::vector<uint8_t> valid(c.budget);
  for (int i = 0; i < c.budget; ++i) valid[i] = unit(rng) >= c.hole_share;
  if (tie) {  // slots 7 and 9 with zero values: equal scores 0, the least; the lower one wins
    for (int h = 0; h < c.kv_heads; ++h) {
      for (int e = 0; e < c.head_dim; ++e) {
        k[(size_t(h) * c.budget + 9) * c.head_dim + e] =
            k[(size_t(h) * c.budget + 7) * c.head_dim + e] = -5.f;
        v[(size_t(h) * c.budget + 9) * c.head_dim + e] =
            v[(size_t(h) * c.budget + 7) * c.head_dim + e] = 0.f;
      }
    }
    valid[7] = valid[9] = 1;
  }
  std::vector<float> out(q.size(), NAN), scores(size_t(c.kv_heads) * c.budget, NAN);
  std::vector<int32_t> next(c.kv_heads, -7);
  std::vector<uint8_t> used_max(c.kv_heads, 9);
  LongFlowAttentionArgs a{q.data(),     out.data(),    c.heads,        k.data(),   v.data(),
                          valid.data(), c.kv_heads,    c.budget,       c.head_dim, c.sink,
                          next.data(),  scores.data(), used_max.data()};
  std::vector<float> scratch(LongFlowAttentionScratchSize(a));
  ASSERT_TRUE(LongFlowAttention(a, scratch).ok());
  const Reference r = Compute(c, q, k, v, valid);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(std::isfinite(out[i]));
    // Scores of magnitude ~key_scale carry fp32 rounding of that size into the weights.
    const double tolerance = 2e-5 * std::max(1.f, c.key_scale);
    ASSERT_NEAR(out[i], r.out[i], tolerance + tolerance * std::fabs(r.out[i])) << "output " << i;
  }
  for (size_t i = 0; i < scores.size(); ++i) {
    ASSERT_NEAR(scores[i], r.scores[i], 1e-6 + 1e-4 * r.scores[i]) << "score " << i;
  }
  for (int h = 0; h < c.kv_heads; ++h) {
    EXPECT_EQ(next[h], r.next[h]) << "KV head " << h;
    EXPECT_EQ(used_max[h], c.key_scale > 10.f ? 1 : 0);
    if (tie && c.hole_share == 0.0) {
      EXPECT_EQ(next[h], 7) << "ties go to the lower slot";
    }
  }
}

TEST(LongFlowAttention, MatchesDoubleReference) {
  uint64_t seed = 1;
  for (int group : {1, 4, 8}) {
    for (int budget : {37, 130, 3200}) {
      RunCase({2 * group, 2, 64, budget, 4, 0.0}, seed++);  // full: argmin past the sinks
      RunCase({2 * group, 2, 32, budget, 4, 0.3}, seed++);  // holes: the lowest free slot
    }
  }
}

TEST(LongFlowAttention, TiesGoToTheLowerSlot) { RunCase({8, 2, 16, 40, 4, 0.0}, 5, /*tie=*/true); }

TEST(LongFlowAttention, LargeScoresFallBackToTheMaxAndStayFinite) {
  RunCase({8, 2, 64, 300, 4, 0.0, /*key_scale=*/200.f}, 9);
}

TEST(LongFlowAttention, EverySlotASinkLeavesNothingToWrite) {
  const Case c{4, 1, 8, 6, 6, 0.0};
  std::vector<float> q(32, 0.1f), k(48, 0.2f), v(48, 0.3f), out(32), scratch(60);
  std::vector<uint8_t> valid(6, 1);
  int32_t next = 3;
  LongFlowAttentionArgs a{q.data(), out.data(), 4, k.data(), v.data(), valid.data(), 1,
                          6,        8,          6, &next,    nullptr,  nullptr};
  ASSERT_TRUE(LongFlowAttention(a, scratch).ok());
  EXPECT_EQ(next, -1);
  a.sink_slots = 7;
  EXPECT_NE(LongFlowAttention(a, scratch).message().find("sink_slots 7 outside"),
            std::string::npos);
  (void)c;
}

}  // namespace
}  // namespace rubato
