// Tests for the CPU twin of the fused q/k-norm, RoPE and KV append against a double-precision
// reference written here: normed and rotated q/k heads in place, k and v at each token's slot in
// the paged pools, nothing written for a negative slot, v rows untouched in qkv.
#include "kernels/cpu/qk_rope_append.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/rope.h"

namespace rubato {
namespace {

constexpr int kHeads = 4, kKvHeads = 2, kDim = 16, kBlockTokens = 4, kBlocks = 3;

// Head `h` of row `row` (q heads, then k) normed (when weights are given) and rotated, in double.
std::vector<double> Reference(const std::vector<float>& row, int h, const float* weight,
                              int position, const std::vector<float>& inv_freq, float eps) {
  std::vector<double> x(row.begin() + h * kDim, row.begin() + (h + 1) * kDim);
  if (weight != nullptr) {
    double sum = 0;
    for (double v : x) sum += v * v;
    const double inv_rms = 1.0 / std::sqrt(sum / kDim + eps);
    for (int i = 0; i < kDim; ++i) x[i] = weight[i] * x[i] * inv_rms;
  }
  std::vector<double> out(kDim);
  for (int i = 0; i < kDim / 2; ++i) {
    const double angle = static_cast<double>(static_cast<float>(position) * inv_freq[i]);
    out[i] = x[i] * std::cos(angle) - x[i + kDim / 2] * std::sin(angle);
    out[i + kDim / 2] = x[i + kDim / 2] * std::cos(angle) + x[i] * std::sin(angle);
  }
  return out;
}

void Check(bool with_norm) {
  std::mt19937 rng(with_norm ? 7 : 8);
  std::uniform_real_distribution<float> value(-2.f, 2.f);
  const int tokens = 5;
  const int64_t stride = (kHeads + 2 * kKvHeads) * kDim + 8;  // padded rows
  std::vector<float> qkv(tokens * stride), q_weight(kDim), k_weight(kDim);
  for (float& v : qkv) v = value(rng);
  for (float& v : q_weight) v = value(rng);
  for (float& v : k_weight) v = value(rng);
  const std::vector<float> before = qkv;
  const std::vector<int> positions = {0, 3, 17, 4095, 100000};
  const std::vector<int32_t> slots = {5, -1, 0, 11, 6};
  const std::vector<float> inv_freq = RopeInverseFrequencies(kDim, 10000.0, RopeScaling{});
  const size_t pool = static_cast<size_t>(kBlocks) * kKvHeads * kBlockTokens * kDim;
  std::vector<float> keys(pool, -7.f), values(pool, -7.f);
  const float eps = 1e-6f;
  QkNormRopeAppend({.qkv = qkv.data(),
                    .row_stride = stride,
                    .tokens = tokens,
                    .num_heads = kHeads,
                    .num_kv_heads = kKvHeads,
                    .head_dim = kDim,
                    .q_norm_weight = with_norm ? q_weight.data() : nullptr,
                    .k_norm_weight = with_norm ? k_weight.data() : nullptr,
                    .eps = eps,
                    .positions = positions,
                    .inv_freq = inv_freq,
                    .slots = slots,
                    .block_tokens = kBlockTokens,
                    .key_pool = keys.data(),
                    .value_pool = values.data()});
  size_t written = 0;
  for (int t = 0; t < tokens; ++t) {
    const std::vector<float> row(before.begin() + t * stride, before.begin() + (t + 1) * stride);
    for (int h = 0; h < kHeads + kKvHeads; ++h) {
      const float* weight = !with_norm ? nullptr : h < kHeads ? q_weight.data() : k_weight.data();
      const std::vector<double> expected = Reference(row, h, weight, positions[t], inv_freq, eps);
      for (int i = 0; i < kDim; ++i) {
        const float got = qkv[t * stride + h * kDim + i];
        ASSERT_NEAR(got, expected[i], 2e-5 * (1 + std::abs(expected[i])))
            << "token " << t << " head " << h << " element " << i;
        if (h >= kHeads && slots[t] >= 0) {
          const int kv = h - kHeads;
          const int64_t at =
              ((slots[t] / kBlockTokens * kKvHeads + kv) * kBlockTokens + slots[t] % kBlockTokens) *
                  kDim +
              i;
          ASSERT_EQ(keys[at], got) << "key of token " << t;
          ASSERT_EQ(values[at], row[(kHeads + kKvHeads + kv) * kDim + i]) << "value of token " << t;
          written += 2;
        }
      }
    }
    for (int64_t i = (kHeads + kKvHeads) * kDim; i < stride; ++i) {
      ASSERT_EQ(qkv[t * stride + i], before[t * stride + i]) << "v or padding of token " << t;
    }
  }
  size_t untouched = 0;
  for (size_t i = 0; i < pool; ++i) untouched += (keys[i] == -7.f) + (values[i] == -7.f);
  EXPECT_EQ(untouched + written, 2 * pool);  // token 1 (slot -1) wrote nothing
}

TEST(QkNormRopeAppend, NormedRotatedAndAppendedAsTheReference) { Check(true); }
TEST(QkNormRopeAppend, WithoutNormWeightsOnlyRotatesAndAppends) { Check(false); }

}  // namespace
}  // namespace rubato
