// Tests for causal paged GQA attention against a naive double-precision reference that reads
// contiguous K/V, over odd sizes, scattered block tables and chunked queries.
#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/all_close_for_test.h"
#include "kernels/cpu/kv_append.h"

namespace rubato {
namespace {

std::vector<float> RandomVector(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_tokens, positions;
};

// Naive attention of query tokens at positions [start, start + tokens) over contiguous
//   keys, values: [positions][kv_heads][head_dim]
std::vector<double> ReferenceAttention(const Shape& s, const std::vector<float>& q,
                                       const std::vector<float>& keys,
                                       const std::vector<float>& values, int start, int tokens) {
  std::vector<double> out(size_t(tokens) * s.num_heads * s.head_dim, 0.0);
  const int group = s.num_heads / s.num_kv_heads;
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < s.num_heads; ++h) {
      const int kvh = h / group;
      const int n = start + t + 1;
      std::vector<double> scores(n);
      for (int p = 0; p < n; ++p) {
        double dot = 0;
        for (int d = 0; d < s.head_dim; ++d) {
          dot += double(q[(size_t(t) * s.num_heads + h) * s.head_dim + d]) *
                 keys[(size_t(p) * s.num_kv_heads + kvh) * s.head_dim + d];
        }
        scores[p] = dot / std::sqrt(double(s.head_dim));
      }
      const double max = *std::max_element(scores.begin(), scores.end());
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - max));
      for (int p = 0; p < n; ++p) {
        for (int d = 0; d < s.head_dim; ++d) {
          out[(size_t(t) * s.num_heads + h) * s.head_dim + d] +=
              scores[p] / sum * values[(size_t(p) * s.num_kv_heads + kvh) * s.head_dim + d];
        }
      }
    }
  }
  return out;
}

class PagedSequence {
 public:
  // A pool with more blocks than needed and a shuffled block table.
  PagedSequence(const Shape& s, uint64_t seed) : shape_(s) {
    const int blocks = (s.positions + s.block_tokens - 1) / s.block_tokens;
    const int pool_blocks = blocks + 3;
    std::vector<int32_t> all(pool_blocks);
    std::iota(all.begin(), all.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(all.begin(), all.end(), rng);
    table_.assign(all.begin(), all.begin() + blocks);
    const size_t pool = size_t(pool_blocks) * s.num_kv_heads * s.block_tokens * s.head_dim;
    keys_.assign(pool, NAN);  // unwritten slots must never be read
    values_.assign(pool, NAN);
  }
  PagedKvView View() {
    return PagedKvView{keys_.data(),        values_.data(),      table_.data(),
                       shape_.block_tokens, shape_.num_kv_heads, shape_.head_dim};
  }

 private:
  Shape shape_;
  std::vector<int32_t> table_;
  std::vector<float> keys_, values_;
};

TEST(CausalAttention, MatchesNaiveReferenceForChunkedQueries) {
  for (const Shape& s : {Shape{4, 2, 16, 16, 37}, Shape{6, 2, 10, 4, 23}, Shape{3, 3, 8, 64, 70},
                         Shape{8, 1, 6, 16, 1}}) {
    const size_t kv_row = size_t(s.num_kv_heads) * s.head_dim;
    const std::vector<float> keys = RandomVector(s.positions * kv_row, 1, 1.0f);
    const std::vector<float> values = RandomVector(s.positions * kv_row, 2, 1.0f);
    const std::vector<float> q =
        RandomVector(size_t(s.positions) * s.num_heads * s.head_dim, 3, 2.0f);
    PagedSequence sequence(s, 7);
    const PagedKvView kv = sequence.View();

    // Queries arrive in chunks of 5 (prefill chunks, then 1-token chunks look the same).
    std::vector<float> output(q.size(), NAN);
    std::vector<float> scratch(s.positions);
    for (int start = 0; start < s.positions; start += 5) {
      const int tokens = std::min(5, s.positions - start);
      AppendToPagedKv(keys.data() + start * kv_row, values.data() + start * kv_row, tokens, start,
                      kv);
      const size_t q_offset = size_t(start) * s.num_heads * s.head_dim;
      CausalAttentionArgs args{
          q.data() + q_offset, output.data() + q_offset, tokens, start, s.num_heads, kv};
      ASSERT_LE(CausalAttentionScratchSize(args), int(scratch.size()));
      CausalAttention(args, scratch.data());
    }
    const std::string name = "attention heads " + std::to_string(s.num_heads) + "/" +
                             std::to_string(s.num_kv_heads) + " dim " + std::to_string(s.head_dim) +
                             " block " + std::to_string(s.block_tokens) + " positions " +
                             std::to_string(s.positions);
    EXPECT_TRUE(
        AllClose(name, output, ReferenceAttention(s, q, keys, values, 0, s.positions), 1e-6, 1e-5));
  }
}

TEST(CausalAttention, FirstTokenAttendsOnlyToItself) {
  const Shape s{2, 1, 4, 16, 1};
  PagedSequence sequence(s, 1);
  const PagedKvView kv = sequence.View();
  const std::vector<float> k = {1, 2, 3, 4}, v = {0.5f, -1, 2, 7};
  AppendToPagedKv(k.data(), v.data(), 1, 0, kv);
  const std::vector<float> q = {9, 9, 9, 9, -3, 1, 0, 2};
  std::vector<float> out(8);
  std::vector<float> scratch(1);
  CausalAttention({q.data(), out.data(), 1, 0, 2, kv}, scratch.data());
  EXPECT_EQ(out, (std::vector<float>{0.5f, -1, 2, 7, 0.5f, -1, 2, 7}));
}

}  // namespace
}  // namespace rubato
