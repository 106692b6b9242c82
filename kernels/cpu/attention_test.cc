// Tests for causal paged GQA attention (rows and tiled paths) against a naive double-precision
// reference that reads contiguous K/V and masks by the attention window, over odd sizes,
// scattered block tables, chunked queries and sink / recent windows.
#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/all_close_for_test.h"
#include "kernels/cpu/exp_approx.h"
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
// Keys outside the window are masked out, written from the definition (k < sink or
// k > p - recent) independently of AttentionWindow's helpers.
std::vector<double> ReferenceAttention(const Shape& s, const std::vector<float>& q,
                                       const std::vector<float>& keys,
                                       const std::vector<float>& values, int start, int tokens,
                                       int sink = 0, int recent = AttentionWindow::kUnbounded) {
  std::vector<double> out(size_t(tokens) * s.num_heads * s.head_dim, 0.0);
  const int group = s.num_heads / s.num_kv_heads;
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < s.num_heads; ++h) {
      const int kvh = h / group;
      const int n = start + t + 1;
      const int position = start + t;
      std::vector<double> scores(n, -INFINITY);
      for (int p = 0; p < n; ++p) {
        if (!(p < sink || int64_t{p} > int64_t{position} - recent)) continue;  // masked
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

using AttentionPath = void (*)(const CausalAttentionArgs&, int, float*);

struct NamedPath {
  const char* name;
  AttentionPath run;
  int (*scratch_size)(const CausalAttentionArgs&);
};

const NamedPath kPaths[] = {{"rows", RowsAttentionForKvHead, RowsAttentionScratchSize},
                            {"tiled", TiledAttentionForKvHead, TiledAttentionScratchSize},
                            {"dispatch", CausalAttentionForKvHead, CausalAttentionScratchSize}};

std::string Describe(const Shape& s, const char* path, int chunk, const AttentionWindow& w) {
  return std::string(path) + " attention heads " + std::to_string(s.num_heads) + "/" +
         std::to_string(s.num_kv_heads) + " dim " + std::to_string(s.head_dim) + " block " +
         std::to_string(s.block_tokens) + " positions " + std::to_string(s.positions) + " chunk " +
         std::to_string(chunk) + " sink " + std::to_string(w.sink_tokens) + " recent " +
         (w.recent_tokens == AttentionWindow::kUnbounded ? "all" : std::to_string(w.recent_tokens));
}

// Appends K/V and runs `path` chunk by chunk over every position; returns the outputs of all
// query tokens, [positions][num_heads][head_dim].
std::vector<float> RunChunked(const Shape& s, const NamedPath& path, int chunk,
                              const AttentionWindow& window, const std::vector<float>& q,
                              const std::vector<float>& keys, const std::vector<float>& values) {
  PagedSequence sequence(s, 7);
  const PagedKvView kv = sequence.View();
  const size_t kv_row = size_t(s.num_kv_heads) * s.head_dim;
  std::vector<float> output(q.size(), NAN);
  std::vector<float> scratch;
  for (int start = 0; start < s.positions; start += chunk) {
    const int tokens = std::min(chunk, s.positions - start);
    AppendToPagedKv(keys.data() + start * kv_row, values.data() + start * kv_row, tokens, start,
                    kv);
    const size_t q_offset = size_t(start) * s.num_heads * s.head_dim;
    const CausalAttentionArgs args{
        q.data() + q_offset, output.data() + q_offset, tokens, start, s.num_heads, kv, window};
    // Exactly the advertised size, NaN-filled: reading scratch before writing it shows up.
    scratch.assign(size_t(path.scratch_size(args)), NAN);
    for (int h = 0; h < s.num_kv_heads; ++h) path.run(args, h, scratch.data());
  }
  return output;
}

// Odd sizes; block tables shuffled; group sizes 1, 2, 3, 8. The tiled path runs several key
// tiles for 301 positions at group 8 (64-key tiles) and 200 at group 3 (170-key tiles).
const Shape kShapes[] = {{4, 2, 16, 16, 37}, {6, 2, 10, 4, 23},   {3, 3, 8, 64, 70},
                         {8, 1, 6, 16, 1},   {8, 1, 12, 16, 301}, {6, 2, 10, 64, 200},
                         {2, 2, 32, 16, 133}};

TEST(CausalAttention, DenseMatchesNaiveReferenceForChunkedQueries) {
  for (const Shape& s : kShapes) {
    const size_t kv_row = size_t(s.num_kv_heads) * s.head_dim;
    const std::vector<float> keys = RandomVector(s.positions * kv_row, 1, 1.0f);
    const std::vector<float> values = RandomVector(s.positions * kv_row, 2, 1.0f);
    const std::vector<float> q =
        RandomVector(size_t(s.positions) * s.num_heads * s.head_dim, 3, 2.0f);
    const std::vector<double> expected = ReferenceAttention(s, q, keys, values, 0, s.positions);
    // Chunks of 1 (decode), 5 (one query tile), 37 (three query tiles, the last partial) and
    // the whole prompt.
    for (const int chunk : {1, 5, 37, s.positions}) {
      for (const NamedPath& path : kPaths) {
        const AttentionWindow dense;
        EXPECT_TRUE(AllClose(Describe(s, path.name, chunk, dense),
                             RunChunked(s, path, chunk, dense, q, keys, values), expected, 1e-6,
                             1e-5));
      }
    }
  }
}

TEST(CausalAttention, WindowMatchesMaskedNaiveReference) {
  for (const Shape& s : kShapes) {
    const size_t kv_row = size_t(s.num_kv_heads) * s.head_dim;
    const std::vector<float> keys = RandomVector(s.positions * kv_row, 4, 1.0f);
    const std::vector<float> values = RandomVector(s.positions * kv_row, 5, 1.0f);
    const std::vector<float> q =
        RandomVector(size_t(s.positions) * s.num_heads * s.head_dim, 6, 2.0f);
    for (const int sink : {0, 1, 4}) {
      for (const int recent : {1, 5, 64}) {
        const AttentionWindow window{sink, recent};
        const std::vector<double> expected =
            ReferenceAttention(s, q, keys, values, 0, s.positions, sink, recent);
        for (const int chunk : {1, 7, 37}) {
          for (const NamedPath& path : kPaths) {
            EXPECT_TRUE(AllClose(Describe(s, path.name, chunk, window),
                                 RunChunked(s, path, chunk, window, q, keys, values), expected,
                                 1e-6, 1e-5));
          }
        }
      }
    }
  }
}

// A window that covers every position is dense, bit for bit (docs/design.md §4: budget >= context
// equals dense).
TEST(CausalAttention, WindowCoveringTheContextIsDense) {
  const Shape s{6, 2, 10, 16, 300};  // key tiles of 170: the sink boundary falls inside one
  const size_t kv_row = size_t(s.num_kv_heads) * s.head_dim;
  const std::vector<float> keys = RandomVector(s.positions * kv_row, 8, 1.0f);
  const std::vector<float> values = RandomVector(s.positions * kv_row, 9, 1.0f);
  const std::vector<float> q =
      RandomVector(size_t(s.positions) * s.num_heads * s.head_dim, 10, 2.0f);
  for (const NamedPath& path : kPaths) {
    const std::vector<float> dense = RunChunked(s, path, 11, {}, q, keys, values);
    for (const AttentionWindow window : {AttentionWindow{0, 300}, AttentionWindow{4, 296},
                                         AttentionWindow{300, 1}, AttentionWindow{150, 150}}) {
      EXPECT_EQ(RunChunked(s, path, 11, window, q, keys, values), dense)
          << Describe(s, path.name, 11, window);
    }
  }
}

// Keys no query of the chunk attends are never read: they are NaN here.
TEST(CausalAttention, KeysOutsideTheWindowAreNeverRead) {
  const Shape s{4, 2, 8, 16, 120};
  const AttentionWindow window{3, 20};
  const size_t kv_row = size_t(s.num_kv_heads) * s.head_dim;
  std::vector<float> keys = RandomVector(s.positions * kv_row, 11, 1.0f);
  std::vector<float> values = RandomVector(s.positions * kv_row, 12, 1.0f);
  const std::vector<float> q =
      RandomVector(size_t(s.positions) * s.num_heads * s.head_dim, 13, 2.0f);
  // The last 10 queries (positions 110..119) attend [0, 3) and [91, 119].
  const int start = 110;
  const int tokens = 10;
  const std::vector<double> expected =
      ReferenceAttention(s, q, keys, values, 0, s.positions, 3, 20);
  std::fill(keys.begin() + 3 * kv_row, keys.begin() + 91 * kv_row, NAN);
  std::fill(values.begin() + 3 * kv_row, values.begin() + 91 * kv_row, NAN);
  PagedSequence sequence(s, 3);
  const PagedKvView kv = sequence.View();
  AppendToPagedKv(keys.data(), values.data(), s.positions, 0, kv);
  for (const NamedPath& path : kPaths) {
    std::vector<float> output(size_t(tokens) * s.num_heads * s.head_dim, NAN);
    const size_t q_offset = size_t(start) * s.num_heads * s.head_dim;
    const CausalAttentionArgs args{
        q.data() + q_offset, output.data(), tokens, start, s.num_heads, kv, window};
    std::vector<float> scratch(size_t(path.scratch_size(args)));
    for (int h = 0; h < s.num_kv_heads; ++h) path.run(args, h, scratch.data());
    EXPECT_TRUE(AllClose(std::string(path.name) + " poisoned keys outside the window", output,
                         std::vector<double>(expected.begin() + q_offset, expected.end()), 1e-6,
                         1e-5));
  }
}

// The tiled path's exp: within 2 ulp of the double-precision exp over the softmax range (and
// beyond), and a tiny positive number below it.
TEST(ExpApprox, WithinTwoUlpOfExp) {
  double max_ulps = 0;
  for (float x = -87.3f; x <= 88.3f; x += 0.000731f) {
    const double exact = std::exp(double(x));
    const double ulp = std::nextafter(float(exact), INFINITY) - float(exact);
    max_ulps = std::max(max_ulps, std::fabs(ExpApprox(x) - exact) / ulp);
  }
  std::cout << "[ max error ] ExpApprox: " << max_ulps << " ulp\n";
  EXPECT_LE(max_ulps, 2.0);
  EXPECT_EQ(ExpApprox(0.0f), 1.0f);
  EXPECT_GT(ExpApprox(-1000.0f), 0.0f);
  EXPECT_LT(ExpApprox(-1000.0f), 1.3e-38f);
}

TEST(AttentionWindow, SegmentsAndVisibleKeys) {
  const AttentionWindow dense;
  EXPECT_TRUE(dense.IsDense());
  EXPECT_EQ(dense.VisibleKeys(0), 1);
  EXPECT_EQ(dense.VisibleKeys(4999), 5000);
  const AttentionWindow streaming{4, 256};
  EXPECT_FALSE(streaming.IsDense());
  EXPECT_EQ(streaming.VisibleKeys(2), 3);      // inside the sink
  EXPECT_EQ(streaming.VisibleKeys(259), 260);  // sink + recent touch: everything
  EXPECT_EQ(streaming.VisibleKeys(260), 260);  // key 4 drops out
  EXPECT_EQ(streaming.VisibleKeys(5002), 260);
  EXPECT_TRUE(streaming.Attends(5002, 3));
  EXPECT_FALSE(streaming.Attends(5002, 4));
  EXPECT_FALSE(streaming.Attends(5002, 4746));
  EXPECT_TRUE(streaming.Attends(5002, 4747));
  EXPECT_FALSE(streaming.Attends(10, 11));  // causal
  EXPECT_EQ((AttentionWindow{0, 1}.VisibleKeys(77)), 1);
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
  CausalAttention({q.data(), out.data(), 1, 0, 2, kv, {}}, scratch.data());
  EXPECT_EQ(out, (std::vector<float>{0.5f, -1, 2, 7, 0.5f, -1, 2, 7}));
}

}  // namespace
}  // namespace rubato
