// Tests for the row-wise and elementwise CPU ops against double-precision references:
// embedding, rmsnorm, qk-norm, swiglu, softmax, residual add and paged KV append.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/add.h"
#include "kernels/cpu/all_close_for_test.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/key_norms.h"
#include "kernels/cpu/kv_append.h"
#include "kernels/cpu/qk_norm.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/softmax.h"
#include "kernels/cpu/swiglu.h"

namespace rubato {
namespace {

std::vector<float> RandomVector(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

std::vector<double> ReferenceRmsNorm(const std::vector<float>& x, const std::vector<float>& w,
                                     int rows, int dim, double eps) {
  std::vector<double> out(x.size());
  for (int r = 0; r < rows; ++r) {
    double sum = 0;
    for (int i = 0; i < dim; ++i) sum += double(x[r * dim + i]) * x[r * dim + i];
    const double inv_rms = 1.0 / std::sqrt(sum / dim + eps);
    for (int i = 0; i < dim; ++i) out[r * dim + i] = w[i] * (x[r * dim + i] * inv_rms);
  }
  return out;
}

TEST(Embedding, GathersRowsAndRejectsOutOfRangeIds) {
  const int vocab = 11, hidden = 7;
  const std::vector<float> table = RandomVector(vocab * hidden, 1);
  const std::vector<int> ids = {3, 0, 10, 3};
  std::vector<float> out(ids.size() * hidden, -1.0f);
  ASSERT_TRUE(EmbeddingLookup(table.data(), vocab, hidden, ids, out.data()).ok());
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int i = 0; i < hidden; ++i) EXPECT_EQ(out[t * hidden + i], table[ids[t] * hidden + i]);
  }
  const std::vector<int> bad = {1, 11};
  const Status status = EmbeddingLookup(table.data(), vocab, hidden, bad, out.data());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("token id 11 at position 1"), std::string::npos)
      << status.message();
}

TEST(RmsNorm, MatchesDoubleReferenceOnOddSizes) {
  for (int dim : {1, 7, 64, 129}) {
    const int rows = 5;
    const std::vector<float> x = RandomVector(rows * dim, dim, 3.0f);
    const std::vector<float> w = RandomVector(dim, dim + 100);
    std::vector<float> out(x.size());
    RmsNorm(x.data(), w.data(), rows, dim, 1e-6f, out.data());
    EXPECT_TRUE(AllClose("rmsnorm dim " + std::to_string(dim), out,
                         ReferenceRmsNorm(x, w, rows, dim, 1e-6), 1e-6, 1e-5));
    // In place gives the same values.
    std::vector<float> in_place = x;
    RmsNorm(in_place.data(), w.data(), rows, dim, 1e-6f, in_place.data());
    EXPECT_EQ(in_place, out);
  }
}

TEST(RmsNorm, EpsilonDominatesTinyInputs) {
  const std::vector<float> x = {1e-4f, -1e-4f, 1e-4f};
  const std::vector<float> w = {1.0f, 2.0f, 3.0f};
  std::vector<float> out(3);
  RmsNorm(x.data(), w.data(), 1, 3, 1e-2f, out.data());
  // mean(x^2) = 1e-8 is negligible against eps = 1e-2: out = w * x / sqrt(0.01 + 1e-8).
  const double inv = 1.0 / std::sqrt(1e-2 + 1e-8);
  EXPECT_TRUE(AllClose("rmsnorm eps", out, std::vector<double>{1e-4 * inv, -2e-4 * inv, 3e-4 * inv},
                       0, 1e-6));
}

TEST(QkNorm, NormalizesEveryHeadSeparately) {
  const int tokens = 3, heads = 5, head_dim = 6;
  std::vector<float> x = RandomVector(tokens * heads * head_dim, 7, 4.0f);
  const std::vector<float> w = RandomVector(head_dim, 8);
  const std::vector<double> expected = ReferenceRmsNorm(x, w, tokens * heads, head_dim, 1e-6);
  HeadRmsNormInPlace(x.data(), w.data(), tokens, heads, head_dim, 1e-6f);
  EXPECT_TRUE(AllClose("qk_norm", x, expected, 1e-6, 1e-5));
}

TEST(SwiGlu, MatchesSiluTimesUp) {
  const int n = 301;
  std::vector<float> gate = RandomVector(n, 3, 4.0f);
  gate[0] = -90.0f;  // exp(90) overflows to inf: silu must give -0, not NaN
  gate[1] = 90.0f;
  const std::vector<float> up = RandomVector(n, 4);
  std::vector<float> out(n);
  SwiGlu(gate.data(), up.data(), n, out.data());
  std::vector<double> expected(n);
  for (int i = 0; i < n; ++i) expected[i] = gate[i] / (1.0 + std::exp(-double(gate[i]))) * up[i];
  EXPECT_TRUE(AllClose("swiglu", out, expected, 1e-6, 1e-5));
}

TEST(Softmax, SumsToOneAndHandlesLargeAndMaskedValues) {
  std::vector<float> x = {1000.0f, 999.0f, -INFINITY, 998.0f, 1000.0f};
  SoftmaxInPlace(x.data(), static_cast<int>(x.size()));
  const double e1 = std::exp(-1.0), e2 = std::exp(-2.0), z = 2 + e1 + e2;
  EXPECT_TRUE(
      AllClose("softmax", x, std::vector<double>{1 / z, e1 / z, 0, e2 / z, 1 / z}, 1e-7, 1e-6));
  for (int n : {1, 13, 1000}) {
    std::vector<float> v = RandomVector(n, n, 5.0f);
    SoftmaxInPlace(v.data(), n);
    double sum = 0;
    for (float p : v) sum += p;
    EXPECT_NEAR(sum, 1.0, 1e-5) << n;
  }
}

TEST(AddInPlace, AddsElementwise) {
  std::vector<float> x = {1, 2, 3};
  const std::vector<float> y = {0.5f, -2, 10};
  AddInPlace(x.data(), y.data(), 3);
  EXPECT_EQ(x, (std::vector<float>{1.5f, 0, 13}));
}

TEST(KvAppend, WritesThroughTheBlockTable) {
  const int block_tokens = 4, kv_heads = 3, head_dim = 5, num_blocks = 6;
  const size_t pool_size = size_t(num_blocks) * kv_heads * block_tokens * head_dim;
  std::vector<float> keys_pool(pool_size, 0.0f), values_pool(pool_size, 0.0f);
  const std::vector<int32_t> table = {4, 1, 5};  // positions 0-3 -> block 4, 4-7 -> 1, 8-11 -> 5
  PagedKvView kv{keys_pool.data(), values_pool.data(), table.data(),
                 block_tokens,     kv_heads,           head_dim};
  // Two appends: positions [0, 6) then [6, 11).
  const std::vector<float> k1 = RandomVector(6 * kv_heads * head_dim, 1);
  const std::vector<float> v1 = RandomVector(6 * kv_heads * head_dim, 2);
  const std::vector<float> k2 = RandomVector(5 * kv_heads * head_dim, 3);
  const std::vector<float> v2 = RandomVector(5 * kv_heads * head_dim, 4);
  AppendToPagedKv(k1.data(), v1.data(), 6, 0, kv);
  AppendToPagedKv(k2.data(), v2.data(), 5, 6, kv);
  for (int p = 0; p < 11; ++p) {
    const std::vector<float>& k = p < 6 ? k1 : k2;
    const std::vector<float>& v = p < 6 ? v1 : v2;
    const int t = p < 6 ? p : p - 6;
    for (int h = 0; h < kv_heads; ++h) {
      const size_t block = table[p / block_tokens];
      const size_t expected_offset =
          ((block * kv_heads + h) * block_tokens + p % block_tokens) * head_dim;
      ASSERT_EQ(kv.Offset(p, h), expected_offset);
      for (int d = 0; d < head_dim; ++d) {
        EXPECT_EQ(keys_pool[expected_offset + d], k[(t * kv_heads + h) * head_dim + d]);
        EXPECT_EQ(values_pool[expected_offset + d], v[(t * kv_heads + h) * head_dim + d]);
      }
    }
  }
  // Blocks outside the table are untouched.
  for (int block : {0, 2, 3}) {
    const size_t begin = size_t(block) * kv_heads * block_tokens * head_dim;
    for (size_t i = begin; i < begin + size_t(kv_heads) * block_tokens * head_dim; ++i) {
      ASSERT_EQ(keys_pool[i], 0.0f);
    }
  }
}

}  // namespace
}  // namespace rubato

namespace rubato {
namespace {

// Key norms (the SFI key-norm prior's input) over a paged layout with a shuffled block table:
// every head's norm of every position in the range, against a double-precision sum written
// here; entries past `count` and a rejected call leave the output alone.
TEST(KeyNormsTest, NormOfEveryHeadAndPositionInTheRange) {
  const int block_tokens = 4, kv_heads = 3, head_dim = 24, blocks = 6;
  std::vector<float> keys =
      RandomVector(static_cast<size_t>(blocks) * kv_heads * block_tokens * head_dim, 41, 2.0f);
  const std::vector<int32_t> table = {5, 0, 3, 1, 4, 2};
  PagedKvView kv{keys.data(), nullptr, table.data(), block_tokens, kv_heads, head_dim};
  const int begin = 3, count = 17, stride = 20;
  std::vector<float> norms(static_cast<size_t>(kv_heads) * stride, -7.0f);
  ASSERT_TRUE(KeyNorms(kv, begin, count, norms.data(), stride).ok());
  for (int h = 0; h < kv_heads; ++h) {
    for (int i = 0; i < stride; ++i) {
      const float got = norms[static_cast<size_t>(h) * stride + i];
      if (i >= count) {
        EXPECT_EQ(got, -7.0f) << "head " << h << " entry " << i << " past count was written";
        continue;
      }
      const int position = begin + i;
      const float* key = keys.data() +
                         ((static_cast<size_t>(table[position / block_tokens]) * kv_heads + h) *
                              block_tokens +
                          position % block_tokens) *
                             head_dim;
      double squares = 0.0;
      for (int d = 0; d < head_dim; ++d) squares += static_cast<double>(key[d]) * key[d];
      EXPECT_EQ(got, static_cast<float>(std::sqrt(squares))) << "head " << h << " position "
                                                             << position;
    }
  }

  const std::vector<float> before = norms;
  EXPECT_EQ(KeyNorms(kv, begin, count, norms.data(), count - 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(KeyNorms(kv, -1, count, norms.data(), stride).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KeyNorms(kv, begin, count, nullptr, stride).code(), StatusCode::kInvalidArgument);
  PagedKvView no_keys = kv;
  no_keys.keys = nullptr;
  const Status status = KeyNorms(no_keys, begin, count, norms.data(), stride);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("keys"), std::string::npos) << status.message();
  EXPECT_EQ(norms, before);
  EXPECT_TRUE(KeyNorms(no_keys, begin, 0, nullptr, 0).ok());  // nothing to do
}

}  // namespace
}  // namespace rubato
