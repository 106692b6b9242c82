// Tests for index-gather sparse decode attention (index_gather_attention.h): against a
// double-precision softmax over each KV head's explicit list (unsorted, duplicate-free, empty,
// odd sizes, GQA 1/4/8, lengths not a multiple of the block), the full ascending list against
// dense decode bit for bit, reads confined to the listed positions, and refused input.
#include "kernels/cpu/index_gather_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/kv_append.h"

namespace rubato {
namespace {

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_tokens, positions;
};

// One layer of one sequence in a paged pool with a shuffled block table; unwritten slots NaN.
struct Paged {
  Paged(const Shape& s, uint64_t seed) : shape(s) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t row = size_t(s.num_kv_heads) * s.head_dim;
    keys.resize(s.positions * row);
    values.resize(s.positions * row);
    for (float& x : keys) x = normal(rng);
    for (float& x : values) x = normal(rng);
    const int blocks = (s.positions + s.block_tokens - 1) / s.block_tokens;
    std::vector<int32_t> all(blocks + 2);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    table.assign(all.begin(), all.begin() + blocks);
    const size_t pool = all.size() * s.num_kv_heads * s.block_tokens * s.head_dim;
    paged_keys.assign(pool, NAN);
    paged_values.assign(pool, NAN);
    AppendToPagedKv(keys.data(), values.data(), s.positions, 0, View());
  }
  PagedKvView View() {
    return PagedKvView{paged_keys.data(),  paged_values.data(), table.data(),
                       shape.block_tokens, shape.num_kv_heads,  shape.head_dim};
  }
  const float* Key(int p, int h) const {
    return keys.data() + (size_t(p) * shape.num_kv_heads + h) * shape.head_dim;
  }
  const float* Value(int p, int h) const {
    return values.data() + (size_t(p) * shape.num_kv_heads + h) * shape.head_dim;
  }
  Shape shape;
  std::vector<float> keys, values, paged_keys, paged_values;
  std::vector<int32_t> table;
};

TEST(IndexGatherAttention, MatchesDoubleReference) {
  const Shape shapes[] = {{2, 2, 24, 16, 37},     // GQA 1, odd head_dim, L not a block multiple
                          {8, 2, 64, 16, 301},    // GQA 4
                          {32, 4, 128, 64, 129},  // GQA 8
                          {16, 2, 32, 16, 5}};
  uint64_t seed = 1;
  for (const Shape& s : shapes) {
    Paged kv(s, seed++);
    std::mt19937_64 rng(seed++);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> q(size_t(s.num_heads) * s.head_dim);
    for (float& x : q) x = normal(rng);
    // Per KV head a shuffled subset of a different size, one head empty when there are two.
    std::vector<std::vector<int>> lists(s.num_kv_heads);
    for (int h = 0; h < s.num_kv_heads; ++h) {
      std::vector<int> all(s.positions);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      const int count = h == 1 ? 0 : std::max(1, s.positions * (h + 1) / (s.num_kv_heads + 2));
      lists[h].assign(all.begin(), all.begin() + count);
    }
    std::vector<const int*> pointers;
    std::vector<int> counts;
    for (const auto& list : lists) {
      pointers.push_back(list.data());
      counts.push_back(int(list.size()));
    }
    std::vector<float> out(q.size(), NAN), lse(s.num_heads, NAN);
    IndexGatherAttentionArgs args{q.data(),  out.data(),  lse.data(),      s.num_heads,
                                  kv.View(), s.positions, pointers.data(), counts.data()};
    std::vector<float> scratch(IndexGatherAttentionScratchSize(args));
    ASSERT_TRUE(IndexGatherAttention(args, scratch).ok());
    const int group = s.num_heads / s.num_kv_heads;
    const double scale = 1.0 / std::sqrt(double(s.head_dim));
    for (int head = 0; head < s.num_heads; ++head) {
      const int h = head / group;
      const std::vector<int>& list = lists[h];
      std::vector<double> logits;
      for (int p : list) {
        double dot = 0;
        for (int d = 0; d < s.head_dim; ++d)
          dot += double(q[head * s.head_dim + d]) * kv.Key(p, h)[d];
        logits.push_back(dot * scale);
      }
      if (list.empty()) {
        EXPECT_EQ(lse[head], -INFINITY);
        for (int d = 0; d < s.head_dim; ++d) EXPECT_EQ(out[head * s.head_dim + d], 0.0f);
        continue;
      }
      const double max = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (double l : logits) sum += std::exp(l - max);
      EXPECT_NEAR(lse[head], max + std::log(sum), 1e-4);
      for (int d = 0; d < s.head_dim; ++d) {
        double expect = 0;
        for (size_t i = 0; i < list.size(); ++i) {
          expect += std::exp(logits[i] - max) / sum * kv.Value(list[i], h)[d];
        }
        EXPECT_NEAR(out[head * s.head_dim + d], expect, 2e-5)
            << "heads " << s.num_heads << "/" << s.num_kv_heads << " head " << head << " d " << d;
      }
    }
  }
}

TEST(IndexGatherAttention, FullAscendingListIsDenseDecodeBitForBit) {
  const Shape shapes[] = {{8, 2, 64, 16, 300}, {32, 4, 128, 64, 517}, {4, 4, 16, 16, 1}};
  uint64_t seed = 100;
  for (const Shape& s : shapes) {
    Paged kv(s, seed++);
    std::mt19937_64 rng(seed++);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> q(size_t(s.num_heads) * s.head_dim);
    for (float& x : q) x = normal(rng);
    std::vector<float> dense(q.size(), NAN);
    const CausalAttentionArgs dense_args{q.data(),    dense.data(), 1, s.positions - 1,
                                         s.num_heads, kv.View(),    {}};
    std::vector<float> dense_scratch(size_t(RowsAttentionScratchSize(dense_args)));
    for (int h = 0; h < s.num_kv_heads; ++h)
      RowsAttentionForKvHead(dense_args, h, dense_scratch.data());

    std::vector<int> all(s.positions);
    std::iota(all.begin(), all.end(), 0);
    std::vector<const int*> pointers(s.num_kv_heads, all.data());
    std::vector<int> counts(s.num_kv_heads, s.positions);
    std::vector<float> out(q.size(), NAN);
    IndexGatherAttentionArgs args{q.data(),  out.data(),  nullptr,         s.num_heads,
                                  kv.View(), s.positions, pointers.data(), counts.data()};
    std::vector<float> scratch(IndexGatherAttentionScratchSize(args));
    ASSERT_TRUE(IndexGatherAttention(args, scratch).ok());
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(out[i], dense[i]) << "element " << i << " of heads " << s.num_heads << "/"
                                  << s.num_kv_heads;
    }
  }
}

TEST(IndexGatherAttention, ReadsOnlyTheListedPositions) {
  const Shape s{8, 2, 32, 16, 70};
  Paged kv(s, 9);
  std::vector<float> q(size_t(s.num_heads) * s.head_dim, 0.5f);
  const std::vector<int> list = {69, 3, 40, 17};
  // Poison every other position: reading one gives NaN.
  for (int p = 0; p < s.positions; ++p) {
    if (std::find(list.begin(), list.end(), p) != list.end()) continue;
    for (int h = 0; h < s.num_kv_heads; ++h) {
      std::fill_n(kv.paged_keys.data() + kv.View().Offset(p, h), s.head_dim, NAN);
      std::fill_n(kv.paged_values.data() + kv.View().Offset(p, h), s.head_dim, NAN);
    }
  }
  std::vector<const int*> pointers(s.num_kv_heads, list.data());
  std::vector<int> counts(s.num_kv_heads, int(list.size()));
  std::vector<float> out(q.size(), NAN);
  IndexGatherAttentionArgs args{q.data(),  out.data(),  nullptr,         s.num_heads,
                                kv.View(), s.positions, pointers.data(), counts.data()};
  std::vector<float> scratch(IndexGatherAttentionScratchSize(args));
  ASSERT_TRUE(IndexGatherAttention(args, scratch).ok());
  for (float x : out) EXPECT_TRUE(std::isfinite(x));
}

TEST(IndexGatherAttention, RefusesBadInputByName) {
  const Shape s{4, 2, 16, 16, 20};
  Paged kv(s, 3);
  std::vector<float> q(size_t(s.num_heads) * s.head_dim, 0.0f), out(q.size());
  std::vector<int> good = {1, 2, 3}, twice = {4, 5, 4}, outside = {0, 20};
  std::vector<float> scratch(8);
  auto run = [&](const std::vector<int>& list, int num_heads) {
    std::vector<const int*> pointers = {good.data(), list.data()};
    std::vector<int> counts = {int(good.size()), int(list.size())};
    IndexGatherAttentionArgs args{q.data(),  out.data(),  nullptr,         num_heads,
                                  kv.View(), s.positions, pointers.data(), counts.data()};
    return IndexGatherAttention(args, scratch).message();
  };
  EXPECT_NE(run(twice, 4).find("positions[1] holds 4 twice"), std::string::npos);
  EXPECT_NE(run(outside, 4).find("positions[1][1] = 20 is outside [0, 20)"), std::string::npos);
  EXPECT_NE(run(good, 3).find("num_heads 3 is not a positive multiple"), std::string::npos);
  EXPECT_EQ(run(good, 4), "");
}

}  // namespace
}  // namespace rubato
