// The selection evidence's CPU twin against the CPU backend's definition: softmax per query
// head of the group over scale * q.k, the max over the group; given the same scores in log2
// units, GroupMaxProbsRow gives those probabilities, and their top-k (SyncKvTopK) is the same.
#include "inference_rank/policies/synckv/kernels/group_max_probs_cpu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "inference_rank/policies/synckv/synckv_cpu_backend.h"

namespace rubato {
namespace {

TEST(GroupMaxProbsCpu, IsTheGroupsMaxPooledSoftmaxWithTheStaticSetExcluded) {
  constexpr int kGroup = 3, kLength = 50;
  std::mt19937_64 rng(3);
  std::normal_distribution<double> logit(0.0, 2.0);
  std::vector<double> logits(kGroup * kLength);
  for (double& x : logits) x = logit(rng);
  std::vector<float> scores(logits.size());  // log2 units, as the decode kernels write them
  for (size_t i = 0; i < logits.size(); ++i)
    scores[i] = static_cast<float>(logits[i] / std::log(2.0));
  std::vector<float> reference(kLength, 0.0f);
  for (int g = 0; g < kGroup; ++g) {
    double max = -INFINITY, sum = 0.0;
    for (int p = 0; p < kLength; ++p) max = std::max(max, logits[g * kLength + p]);
    for (int p = 0; p < kLength; ++p) sum += std::exp(logits[g * kLength + p] - max);
    for (int p = 0; p < kLength; ++p) {
      reference[p] =
          std::max(reference[p], static_cast<float>(std::exp(logits[g * kLength + p] - max) / sum));
    }
  }
  const std::vector<int32_t> excluded = {4, 17, 30};
  std::vector<float> got(kLength);
  GroupMaxProbsRow(scores.data(), kLength, kGroup, kLength, excluded.data(), 3, got.data());
  for (int p = 0; p < kLength; ++p) {
    if (p == 4 || p == 17 || p == 30) {
      EXPECT_EQ(got[p], -std::numeric_limits<float>::infinity());
    } else {
      EXPECT_NEAR(got[p], reference[p], 1e-6 + 1e-5 * reference[p]) << "position " << p;
    }
  }
  EXPECT_EQ(SyncKvTopK(got, 10, {}), SyncKvTopK(reference, 10, {4, 17, 30}));
}

}  // namespace
}  // namespace rubato
