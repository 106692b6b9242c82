// Tests for RoPE: default and llama3-scaled inverse frequencies against values computed by hand
// from the formulas, cos/sin tables, and the rotate_half rotation against a double reference.
#include "kernels/cpu/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "kernels/cpu/all_close_for_test.h"

namespace rubato {
namespace {

TEST(RopeInverseFrequencies, DefaultIsThetaToTheMinusTwoIOverDim) {
  const int head_dim = 10;
  const std::vector<float> inv_freq = RopeInverseFrequencies(head_dim, 10000.0, RopeScaling{});
  ASSERT_EQ(inv_freq.size(), 5u);
  std::vector<double> expected;
  for (int i = 0; i < 5; ++i) {
    // torch rounds the exponent arange(0, dim, 2).float() / dim to fp32 first (6 / 10 becomes
    // 0.60000002), which moves 10000^-x by ~2e-7 relative; the reference does the same.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    expected.push_back(1.0 / std::pow(10000.0, static_cast<double>(exponent)));
  }
  EXPECT_TRUE(AllClose("default inv_freq", inv_freq, expected, 0, 1.2e-7));
  EXPECT_EQ(inv_freq[0], 1.0f);
}

// head_dim 8, theta 500000, factor 8, low 1, high 4, original context 8192:
//   inv_freq  = 500000^(-i/4) = 1, 0.0376060, 0.00141421, 5.31830e-5
//   wavelen   = 2 pi / inv_freq = 6.28, 167.1, 4442.9, 118144
// thresholds: high_freq_wavelen = 8192 / 4 = 2048, low_freq_wavelen = 8192 / 1 = 8192.
//   i = 0, 1: wavelen < 2048, kept
//   i = 2:    2048 <= 4442.9 <= 8192, smoothed: s = (8192 / wavelen - 1) / (4 - 1)
//             inv = (1 - s) * inv / 8 + s * inv
//   i = 3:    wavelen > 8192, divided by 8
TEST(RopeInverseFrequencies, Llama3ScalingByHand) {
  RopeScaling scaling;
  scaling.type = RopeScaling::Type::kLlama3;
  scaling.factor = 8.0;
  scaling.low_freq_factor = 1.0;
  scaling.high_freq_factor = 4.0;
  scaling.original_max_position_embeddings = 8192;
  const std::vector<float> inv_freq = RopeInverseFrequencies(8, 500000.0, scaling);
  ASSERT_EQ(inv_freq.size(), 4u);

  const double f2 = std::pow(500000.0, -0.5);
  const double wavelen2 = 2 * std::numbers::pi / f2;
  ASSERT_GT(wavelen2, 2048.0);
  ASSERT_LT(wavelen2, 8192.0);
  const double smooth = (8192.0 / wavelen2 - 1.0) / 3.0;
  const std::vector<double> expected = {1.0, std::pow(500000.0, -0.25),
                                        (1 - smooth) * f2 / 8 + smooth * f2,
                                        std::pow(500000.0, -0.75) / 8};
  EXPECT_TRUE(AllClose("llama3 inv_freq", inv_freq, expected, 0, 1e-6));
  // The same numbers worked out on paper: wavelen2 = 4442.88, s = 0.28128,
  // 0.71872 * 1.76777e-4 + 0.28128 * 1.41421e-3 = 5.2485e-4; 5.31830e-5 / 8 = 6.6479e-6.
  EXPECT_NEAR(inv_freq[2], 5.2485e-4, 1e-8);
  EXPECT_NEAR(inv_freq[3], 6.6479e-6, 1e-10);
}

TEST(RopeCosSin, AnglesArePositionTimesInverseFrequency) {
  const std::vector<float> inv_freq = {1.0f, 0.1f, 0.001f};
  const std::vector<int> positions = {0, 1, 7, 1000};
  std::vector<float> cos(12), sin(12);
  RopeCosSin(positions, inv_freq, cos.data(), sin.data());
  std::vector<double> expected_cos, expected_sin;
  for (int p : positions) {
    for (float f : inv_freq) {
      const double angle = static_cast<float>(static_cast<float>(p) * f);
      expected_cos.push_back(std::cos(angle));
      expected_sin.push_back(std::sin(angle));
    }
  }
  EXPECT_TRUE(AllClose("rope cos", cos, expected_cos, 1e-7, 0));
  EXPECT_TRUE(AllClose("rope sin", sin, expected_sin, 1e-7, 0));
  EXPECT_EQ(cos[0], 1.0f);
  EXPECT_EQ(sin[0], 0.0f);
}

TEST(ApplyRope, RotatesHalvesLikeTransformersAndKeepsNorms) {
  const int tokens = 3, heads = 5, head_dim = 12, half = 6;
  const std::vector<float> inv_freq = RopeInverseFrequencies(head_dim, 10000.0, RopeScaling{});
  const std::vector<int> positions = {0, 5, 1234};
  std::vector<float> cos(tokens * half), sin(tokens * half);
  RopeCosSin(positions, inv_freq, cos.data(), sin.data());

  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> x(tokens * heads * head_dim);
  for (float& v : x) v = normal(rng);
  const std::vector<float> original = x;
  ApplyRope(x.data(), tokens, heads, head_dim, cos.data(), sin.data());

  // q * cat(cos, cos) + rotate_half(q) * cat(sin, sin), rotate_half(q) = cat(-q2, q1).
  std::vector<double> expected(x.size());
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < heads; ++h) {
      const float* q = original.data() + (t * heads + h) * head_dim;
      double* out = expected.data() + (t * heads + h) * head_dim;
      for (int i = 0; i < head_dim; ++i) {
        const double c = cos[t * half + i % half], s = sin[t * half + i % half];
        const double rotated = i < half ? -double(q[i + half]) : q[i - half];
        out[i] = q[i] * c + rotated * s;
      }
      double norm_before = 0, norm_after = 0;
      for (int i = 0; i < head_dim; ++i) {
        norm_before += double(q[i]) * q[i];
        const double y = x[(t * heads + h) * head_dim + i];
        norm_after += y * y;
      }
      EXPECT_NEAR(norm_after, norm_before, 1e-5 * norm_before);
    }
  }
  EXPECT_TRUE(AllClose("apply rope", x, expected, 1e-6, 1e-6));
  // Position 0 is the identity.
  for (int i = 0; i < heads * head_dim; ++i) ASSERT_EQ(x[i], original[i]);
}

}  // namespace
}  // namespace rubato
