// Tests for the fidelity guard's signal (fidelity_guard.h): RoPE's rotation is taken out (a query
// rotated to a later position has cosine 1 with itself remembered earlier), the cosine is the mean
// over query heads, a layer without a reference reads -1, the threshold rule (1 always fires),
// the config range and the stats figure.
#include "inference_rank/attention/fidelity_guard.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/rope.h"

namespace rubato {
namespace {

constexpr int kHeads = 3;
constexpr int kHeadDim = 8;

// `x` ([kHeads][kHeadDim]) rotated by RoPE at `position`, as the model rotates its queries.
std::vector<float> Rotated(std::vector<float> x, int position, const std::vector<float>& inv_freq) {
  std::vector<float> cos(kHeadDim / 2), sin(kHeadDim / 2);
  const int positions[] = {position};
  RopeCosSin(positions, inv_freq, cos.data(), sin.data());
  ApplyRope(x.data(), 1, kHeads, kHeadDim, cos.data(), sin.data());
  return x;
}

TEST(FidelityGuard, DriftIgnoresThePositionAndAveragesTheHeads) {
  const std::vector<float> inv_freq = RopeInverseFrequencies(kHeadDim, 10000.0, RopeScaling());
  const QueryDriftGuard::Shape shape{kHeads, kHeadDim, inv_freq.data()};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> content(kHeads * kHeadDim);
  for (float& x : content) x = normal(rng);

  QueryDriftGuard guard;
  EXPECT_EQ(guard.LayerCosine(2, content.data(), 5, shape), -1.0);  // no reference yet
  guard.Remember(2, Rotated(content, 100, inv_freq).data(), 100, shape);
  EXPECT_TRUE(guard.HasReference(2));
  EXPECT_FALSE(guard.HasReference(1));
  // The same content 37 positions later: no drift, though the rotated vectors differ.
  const std::vector<float> later = Rotated(content, 137, inv_freq);
  EXPECT_NEAR(guard.LayerCosine(2, later.data(), 137, shape), 1.0, 1e-5);
  double raw = 0, aa = 0, bb = 0;
  const std::vector<float> at_100 = Rotated(content, 100, inv_freq);
  for (int d = 0; d < kHeadDim; ++d) {
    raw += double(at_100[d]) * later[d];
    aa += double(at_100[d]) * at_100[d];
    bb += double(later[d]) * later[d];
  }
  EXPECT_LT(raw / std::sqrt(aa * bb), 0.99) << "the rotation changes nothing: no test";

  // One head's content reversed: that head's cosine is -1, the mean (1 + 1 - 1) / 3.
  std::vector<float> flipped = content;
  for (int d = 0; d < kHeadDim; ++d) flipped[kHeadDim + d] = -flipped[kHeadDim + d];
  EXPECT_NEAR(guard.LayerCosine(2, Rotated(flipped, 140, inv_freq).data(), 140, shape), 1.0 / 3,
              1e-5);
}

TEST(FidelityGuard, ThresholdRangeAndStats) {
  EXPECT_TRUE(QueryDriftGuard::Fires(0.5, 0.49));
  EXPECT_FALSE(QueryDriftGuard::Fires(0.5, 0.5));
  EXPECT_TRUE(QueryDriftGuard::Fires(1.0, 1.0));  // 1: every check
  EXPECT_TRUE(ValidateFidelityGuard(0.0).ok());
  EXPECT_TRUE(ValidateFidelityGuard(1.0).ok());
  const Status bad = ValidateFidelityGuard(1.5);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("policy.fidelity_guard"), std::string::npos) << bad.message();
  FidelityGuardCounters counters;
  counters.firings = 3;
  counters.steps = 8;
  EXPECT_EQ(FidelityGuardStats("sfi", counters),
            " sfi_guard_firings=3 sfi_guard_firings_per_100_steps=37.5");
  EXPECT_EQ(FidelityGuardStats("sfi", FidelityGuardCounters()),
            " sfi_guard_firings=0 sfi_guard_firings_per_100_steps=0.0");
}

}  // namespace
}  // namespace rubato
