// AdjustLogits (kernels/cuda/logit_adjust.cuh) against its CPU twin ApplyLogitDeltas, bit for
// bit: rows with penalties, bias, both or neither, a vocabulary of odd size, out-of-range tokens
// skipped, and bad parameters.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/sampling.h"
#include "kernels/cuda/logit_adjust.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::Upload;

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

TEST(AdjustLogitsOpTest, MatchesApplyLogitDeltasBitwise) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::uniform_real_distribution<float> value(-30.f, 30.f);
  std::uniform_real_distribution<float> penalty(-2.f, 2.f);
  for (int vocab : {1, 37, 151936}) {
    for (int rows : {1, 5, 33}) {
      std::vector<float> logits(size_t(rows) * vocab);
      for (float& l : logits) l = value(rng);
      std::vector<LogitDelta> deltas;
      std::vector<int32_t> offsets = {0};
      std::vector<int> scratch;
      for (int r = 0; r < rows; ++r) {
        // Row r % 4: 0 nothing, 1 penalties, 2 bias, 3 both (some tokens in both).
        std::vector<int> generated(rng() % 200);
        for (int& t : generated) t = int(rng() % uint64_t(std::min(vocab, 64)));
        std::vector<std::pair<int, float>> bias;
        for (int t = 0; t < std::min(vocab, 40); t += 3) bias.push_back({t, value(rng)});
        LogitAdjustments adjustments;
        if (r % 4 == 1 || r % 4 == 3) {
          adjustments.presence_penalty = penalty(rng);
          adjustments.frequency_penalty = penalty(rng);
          adjustments.generated = generated;
        }
        if (r % 4 >= 2) adjustments.logit_bias = bias;
        BuildLogitDeltas(adjustments, scratch, deltas);
        offsets.push_back(int32_t(deltas.size()));
      }
      std::vector<float> expected = logits;
      for (int r = 0; r < rows; ++r) {
        ApplyLogitDeltas(std::span<float>(expected).subspan(size_t(r) * vocab, size_t(vocab)),
                         std::span<const LogitDelta>(deltas).subspan(
                             size_t(offsets[r]), size_t(offsets[r + 1] - offsets[r])));
      }
      if (deltas.empty()) deltas.push_back({});  // a valid device pointer for the empty batch
      auto device_logits = Upload(logits);
      auto device_offsets = Upload(offsets);
      auto device_deltas = Upload(deltas);
      AdjustLogitsParams params;
      params.logits = device_logits.data();
      params.rows = rows;
      params.vocab_size = vocab;
      params.row_offsets = device_offsets.data();
      params.deltas = device_deltas.data();
      ASSERT_STATUS_OK(AdjustLogits(params, nullptr));
      const std::vector<float> got = Download(device_logits);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(SameBits(got[i], expected[i]))
            << "vocab " << vocab << " rows " << rows << " at " << i << ": " << got[i] << " vs "
            << expected[i];
      }
    }
  }
}

TEST(AdjustLogitsOpTest, OutOfRangeTokensAreSkipped) {
  const std::vector<float> logits = {1.f, 2.f, 3.f};
  const std::vector<int32_t> offsets = {0, 3};
  const std::vector<LogitDelta> deltas = {{-1, 5.f, 0.f}, {1, 0.5f, 0.25f}, {3, 5.f, 0.f}};
  auto device_logits = Upload(logits);
  auto device_offsets = Upload(offsets);
  auto device_deltas = Upload(deltas);
  AdjustLogitsParams params{device_logits.data(), 1, 3, device_offsets.data(),
                            device_deltas.data()};
  ASSERT_STATUS_OK(AdjustLogits(params, nullptr));
  EXPECT_EQ(Download(device_logits), (std::vector<float>{1.f, 2.25f, 3.f}));
}

TEST(AdjustLogitsOpTest, BadParametersAreNamed) {
  AdjustLogitsParams params;
  ASSERT_STATUS_OK(AdjustLogits(params, nullptr));  // rows 0: a no-op, pointers unused
  params.rows = -1;
  EXPECT_TRUE(
      gpu_test::FailsWith(AdjustLogits(params, nullptr), StatusCode::kInvalidArgument, "rows"));
  params.rows = 1;
  params.vocab_size = 0;
  EXPECT_TRUE(gpu_test::FailsWith(AdjustLogits(params, nullptr), StatusCode::kInvalidArgument,
                                  "vocab_size"));
  params.vocab_size = 3;
  EXPECT_TRUE(
      gpu_test::FailsWith(AdjustLogits(params, nullptr), StatusCode::kInvalidArgument, "logits"));
}

}  // namespace
}  // namespace rubato::cuda
