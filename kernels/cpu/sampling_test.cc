// Tests for greedy and filtered sampling: tie breaking, top-k / top-p sets, temperature,
// seeded determinism, the empirical distribution of draws, and the token's probability.
#include "kernels/cpu/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <vector>

namespace rubato {
namespace {

TEST(ArgMax, PicksLowestIndexAmongTiesAndSkipsNaN) {
  EXPECT_EQ(ArgMax(std::vector<float>{1, 3, 2, 3}), 1);
  EXPECT_EQ(ArgMax(std::vector<float>{-INFINITY, -5}), 1);
  EXPECT_EQ(ArgMax(std::vector<float>{NAN, 0.5f, NAN, 2}), 3);
  EXPECT_EQ(ArgMax(std::vector<float>{7}), 0);
}

TEST(SampleToken, SameSeedSameTokensDifferentSeedDifferentTokens) {
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[i] = std::sin(i * 0.7f);
  const SamplingFilter filter{0.8f, 20, 0.95f};
  SamplingWorkspace workspace;
  auto draw = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int> tokens;
    for (int i = 0; i < 64; ++i) tokens.push_back(SampleToken(logits, filter, rng, workspace));
    return tokens;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
}

TEST(SampleToken, TopKNeverLeavesTheKBest) {
  std::mt19937_64 data_rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> logits(97);
  for (float& x : logits) x = normal(data_rng);
  std::vector<int> order(97);
  for (int i = 0; i < 97; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  const std::set<int> best5(order.begin(), order.begin() + 5);

  std::mt19937_64 rng(1);
  SamplingWorkspace workspace;
  std::set<int> seen;
  for (int i = 0; i < 3000; ++i) {
    // A high temperature flattens the distribution so that every allowed token shows up.
    const int token = SampleToken(logits, SamplingFilter{5.0f, 5, 1.0f}, rng, workspace);
    ASSERT_TRUE(best5.count(token)) << "token " << token << " is not among the 5 best";
    seen.insert(token);
  }
  EXPECT_EQ(seen, best5);
}

TEST(SampleToken, TopKBreaksTiesTowardLowerIds) {
  const std::vector<float> logits = {1, 2, 2, 2, 0};
  SamplingWorkspace workspace;
  FilteredDistribution(logits, SamplingFilter{1.0f, 2, 1.0f}, workspace);
  EXPECT_EQ(workspace.candidates, (std::vector<int>{1, 2}));
}

TEST(SampleToken, TopPKeepsTheSmallestNucleus) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (ids 2, 0, 3, 1).
  const std::vector<float> logits = {std::log(0.3f), std::log(0.05f), std::log(0.5f),
                                     std::log(0.15f)};
  SamplingWorkspace workspace;
  FilteredDistribution(logits, SamplingFilter{1.0f, 0, 0.75f}, workspace);
  EXPECT_EQ(workspace.candidates, (std::vector<int>{2, 0}));
  ASSERT_EQ(workspace.probabilities.size(), 2u);
  EXPECT_NEAR(workspace.probabilities[0], 0.625, 1e-6);
  EXPECT_NEAR(workspace.probabilities[1], 0.375, 1e-6);

  FilteredDistribution(logits, SamplingFilter{1.0f, 0, 0.85f}, workspace);
  EXPECT_EQ(workspace.candidates, (std::vector<int>{2, 0, 3}));

  // A tiny top_p still keeps the most probable token.
  FilteredDistribution(logits, SamplingFilter{1.0f, 0, 1e-6f}, workspace);
  EXPECT_EQ(workspace.candidates, (std::vector<int>{2}));
  std::mt19937_64 rng(9);
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(SampleToken(logits, SamplingFilter{1.0f, 0, 1e-6f}, rng, workspace), 2);
  }

  // top-k first, then top-p over the renormalized top-k set: {2: 0.625, 0: 0.375} with top_p
  // 0.6 keeps only id 2.
  FilteredDistribution(logits, SamplingFilter{1.0f, 2, 0.6f}, workspace);
  EXPECT_EQ(workspace.candidates, (std::vector<int>{2}));
}

TEST(SampleToken, DrawFrequenciesFollowSoftmaxOfLogitsOverTemperature) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f};
  SamplingWorkspace workspace;
  for (float temperature : {1.0f, 2.0f}) {
    std::vector<double> expected(3);
    double z = 0;
    for (int i = 0; i < 3; ++i) z += (expected[i] = std::exp(logits[i] / temperature));
    std::mt19937_64 rng(11);
    std::vector<int> counts(3, 0);
    const int draws = 20000;
    for (int i = 0; i < draws; ++i) {
      ++counts[SampleToken(logits, SamplingFilter{temperature, 0, 1.0f}, rng, workspace)];
    }
    for (int i = 0; i < 3; ++i) {
      // Binomial standard deviation is below 0.0036 here; 0.015 is more than 4 sigma.
      EXPECT_NEAR(double(counts[i]) / draws, expected[i] / z, 0.015)
          << "token " << i << " temperature " << temperature;
    }
  }
}

TEST(SampleToken, VeryLowTemperatureIsGreedy) {
  const std::vector<float> logits = {0.1f, 0.3f, 0.2f};
  SamplingWorkspace workspace;
  std::mt19937_64 rng(2);
  for (int i = 0; i < 200; ++i) {
    ASSERT_EQ(SampleToken(logits, SamplingFilter{0.005f, 0, 1.0f}, rng, workspace), 1);
  }
}

TEST(SampleToken, NegativeInfinityIsNeverDrawn) {
  const std::vector<float> logits = {-INFINITY, 0.0f, -INFINITY, 0.0f};
  SamplingWorkspace workspace;
  std::mt19937_64 rng(4);
  for (int i = 0; i < 500; ++i) {
    const int token = SampleToken(logits, SamplingFilter{1.0f, 0, 1.0f}, rng, workspace);
    ASSERT_TRUE(token == 1 || token == 3) << token;
  }
}

TEST(SampleTokenWithUniform, SampleTokenIsDrawUniformThenSampleTokenWithUniform) {
  std::mt19937_64 data_rng(21);
  std::normal_distribution<float> normal;
  std::vector<float> logits(301);
  for (float& x : logits) x = 2.0f * normal(data_rng);
  SamplingWorkspace workspace;
  for (const SamplingFilter& filter :
       {SamplingFilter{1.0f, 0, 1.0f}, SamplingFilter{0.7f, 40, 1.0f},
        SamplingFilter{1.3f, 0, 0.9f}, SamplingFilter{0.9f, 25, 0.8f}}) {
    std::mt19937_64 a(77), b(77);
    for (int i = 0; i < 200; ++i) {
      const int token = SampleToken(logits, filter, a, workspace);
      const double u = DrawUniform(b);
      ASSERT_GE(u, 0.0);
      ASSERT_LT(u, 1.0);
      ASSERT_EQ(token, SampleTokenWithUniform(logits, filter, u, workspace)) << "draw " << i;
    }
    EXPECT_EQ(a(), b()) << "both consumed exactly one draw per token";
  }
}

TEST(SampleTokenWithUniform, UniformWalksTheCumulativeDistribution) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (ids 2, 0, 3, 1).
  const std::vector<float> logits = {std::log(0.3f), std::log(0.05f), std::log(0.5f),
                                     std::log(0.15f)};
  SamplingWorkspace workspace;
  // top-p 0.99 sorts the candidates (2, 0, 3, 1) and keeps all four.
  const SamplingFilter sorted{1.0f, 0, 0.99f};
  EXPECT_EQ(SampleTokenWithUniform(logits, sorted, 0.0, workspace), 2);
  EXPECT_EQ(SampleTokenWithUniform(logits, sorted, 0.49, workspace), 2);
  EXPECT_EQ(SampleTokenWithUniform(logits, sorted, 0.51, workspace), 0);
  EXPECT_EQ(SampleTokenWithUniform(logits, sorted, 0.81, workspace), 3);
  EXPECT_EQ(SampleTokenWithUniform(logits, sorted, 0.96, workspace), 1);
  EXPECT_EQ(SampleTokenWithUniform(logits, sorted, 1.0 - 0x1.0p-53, workspace), 1);
  // Without filters the walk is in id order: 0.3 (id 0), 0.05 (id 1), 0.5 (id 2), 0.15 (id 3).
  const SamplingFilter unfiltered{1.0f, 0, 1.0f};
  EXPECT_EQ(SampleTokenWithUniform(logits, unfiltered, 0.29, workspace), 0);
  EXPECT_EQ(SampleTokenWithUniform(logits, unfiltered, 0.31, workspace), 1);
  EXPECT_EQ(SampleTokenWithUniform(logits, unfiltered, 0.36, workspace), 2);
  EXPECT_EQ(SampleTokenWithUniform(logits, unfiltered, 0.86, workspace), 3);
}

TEST(SampleTokenWithUniform, UniformAtOneNeverPicksAZeroProbabilityCandidate) {
  // top-k 3 keeps the two -inf entries after id 2; a uniform at (or, by rounding, above) the
  // last cumulative value must still pick a drawable token.
  const std::vector<float> logits = {-INFINITY, 0.5f, 1.0f, -INFINITY};
  SamplingWorkspace workspace;
  FilteredDistribution(logits, SamplingFilter{1.0f, 3, 1.0f}, workspace);
  ASSERT_EQ(workspace.candidates, (std::vector<int>{2, 1, 0}));
  EXPECT_EQ(SampleTokenWithUniform(logits, SamplingFilter{1.0f, 3, 1.0f}, 1.0, workspace), 1);
  EXPECT_EQ(SampleTokenWithUniform(logits, SamplingFilter{1.0f, 0, 1.0f}, 1.0, workspace), 2);
}

TEST(TokenProbability, IsSoftmaxAtTemperatureOne) {
  const std::vector<float> logits = {1.0f, 3.0f, -INFINITY, 0.5f, 3.0f};
  const double total = std::exp(1.0 - 3.0) + 2.0 + std::exp(0.5 - 3.0);
  EXPECT_NEAR(TokenProbability(logits, 1), 1.0 / total, 1e-7);
  EXPECT_NEAR(TokenProbability(logits, 0), std::exp(-2.0) / total, 1e-7);
  EXPECT_EQ(TokenProbability(logits, 2), 0.0f);  // -inf
  // Shift invariance: the model's confidence does not depend on a constant added to the row.
  std::vector<float> shifted = logits;
  for (float& value : shifted) value += 1000.0f;
  EXPECT_NEAR(TokenProbability(shifted, 4), TokenProbability(logits, 4), 1e-6);
}

TEST(TokenProbability, NaNIsSkippedAndNonFiniteMaximaGiveZero) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NEAR(TokenProbability(std::vector<float>{nan, 0.0f, 0.0f}, 1), 0.5f, 1e-7);
  EXPECT_EQ(TokenProbability(std::vector<float>{nan, 0.0f, 0.0f}, 0), 0.0f);
  EXPECT_EQ(TokenProbability(std::vector<float>{-INFINITY, -INFINITY}, 0), 0.0f);
  EXPECT_EQ(TokenProbability(std::vector<float>{INFINITY, 1.0f}, 0), 0.0f);
  EXPECT_EQ(TokenProbability(std::vector<float>{7.0f}, 0), 1.0f);
}

TEST(LogitAdjustments, BiasAndPenaltiesFollowOpenAiFormula) {
  std::vector<float> logits = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f};
  const std::vector<int> generated = {5, 2, 5, 5, 0};
  const std::vector<std::pair<int, float>> bias = {{1, 10.0f}, {5, -0.5f}};
  LogitAdjustments adjustments;
  adjustments.presence_penalty = 0.25f;
  adjustments.frequency_penalty = 0.5f;
  adjustments.generated = generated;
  adjustments.logit_bias = bias;
  ASSERT_TRUE(adjustments.active());
  // Reference: logits[t] + bias[t] - frequency * count[t] - presence * (count[t] > 0).
  const std::vector<float> expected = {
      1.0f - 0.5f - 0.25f,       2.0f + 10.0f, 3.0f - 0.5f - 0.25f, 4.0f, 5.0f,
      6.0f - 0.5f - 1.5f - 0.25f};
  SamplingWorkspace workspace;
  ApplyLogitAdjustments(logits, adjustments, workspace);
  for (size_t i = 0; i < logits.size(); ++i) EXPECT_FLOAT_EQ(logits[i], expected[i]) << i;
  // Nothing to apply: inactive (penalties without generated tokens change nothing).
  LogitAdjustments idle;
  idle.presence_penalty = 2.0f;
  EXPECT_FALSE(idle.active());
}

// The deltas behind ApplyLogitAdjustments (the CUDA op's input): one per touched token, in
// token order, appended after what `out` held (the rows of a batch share one array).
TEST(LogitAdjustments, DeltasMergeBiasAndPenaltyPerTokenInTokenOrder) {
  const std::vector<int> generated = {5, 2, 5, 5, 0};
  const std::vector<std::pair<int, float>> bias = {{5, -0.5f}, {1, 10.0f}};
  LogitAdjustments adjustments;
  adjustments.presence_penalty = 0.25f;
  adjustments.frequency_penalty = 0.5f;
  adjustments.generated = generated;
  adjustments.logit_bias = bias;
  std::vector<int> scratch;
  std::vector<LogitDelta> out = {{3, 1.0f, 0.0f}};  // a previous row's delta stays first
  BuildLogitDeltas(adjustments, scratch, out);
  ASSERT_EQ(out.size(), 5u);
  EXPECT_EQ(out[0].token, 3);
  const int tokens[] = {0, 1, 2, 5};
  const float biases[] = {0.0f, 10.0f, 0.0f, -0.5f};
  const float penalties[] = {0.75f, 0.0f, 0.75f, 1.75f};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(out[1 + i].token, tokens[i]) << i;
    EXPECT_EQ(out[1 + i].bias, biases[i]) << i;
    EXPECT_EQ(out[1 + i].penalty, penalties[i]) << i;
  }
  // Bias only, no penalties: the bias entries, sorted; inactive adjustments append nothing.
  adjustments.presence_penalty = adjustments.frequency_penalty = 0.0f;
  out.clear();
  BuildLogitDeltas(adjustments, scratch, out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].token, 1);
  EXPECT_EQ(out[1].token, 5);
  BuildLogitDeltas(LogitAdjustments{}, scratch, out);
  EXPECT_EQ(out.size(), 2u);
}

}  // namespace
}  // namespace rubato
