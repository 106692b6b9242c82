// RandomFill (kernels/cuda/random_fill.cuh): every element equals the host twin bit for bit
// (so fills are deterministic across runs and launch shapes), values stay inside
// [center - bound, center + bound], the sample mean and variance are those of a uniform
// distribution, different seeds / streams differ, and bad parameters are rejected.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/random_fill.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::FromBf16;
using gpu_test::Poisoned;

uint16_t Bits(__nv_bfloat16 value) {
  uint16_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Fills `count` elements starting `offset` elements into a poisoned buffer (offset 1 makes the
// buffer 2-byte but not 16-byte aligned: the element-wise path) and checks them against
// RandomFillValue bit for bit; the elements around the fill must stay poisoned.
void ExpectMatchesHostTwin(RandomFillParams params, int64_t offset) {
  auto buffer = Poisoned<__nv_bfloat16>(static_cast<size_t>(params.count + offset + 3));
  params.out = buffer.data() + offset;
  ASSERT_STATUS_OK(RandomFill(params, nullptr));
  const std::vector<__nv_bfloat16> host = Download(buffer);
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < params.count; ++i) {
    const uint16_t want = F32ToBf16(RandomFillValue(params, i));
    if (Bits(host[static_cast<size_t>(offset + i)]) != want && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0) << "count " << params.count << " offset " << offset
                           << ": first mismatch at " << first;
  for (int64_t i = 0; i < offset; ++i) EXPECT_EQ(Bits(host[static_cast<size_t>(i)]), 0xffff);
  for (int64_t i = offset + params.count; i < static_cast<int64_t>(host.size()); ++i) {
    EXPECT_EQ(Bits(host[static_cast<size_t>(i)]), 0xffff) << "written past the end at " << i;
  }
}

TEST(RandomFillOpTest, MatchesHostTwinForOddSizesAndAlignments) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  for (int64_t count : {1, 7, 8, 9, 4099, 65537, 1 << 20}) {
    for (int64_t offset : {0, 1, 8}) {
      RandomFillParams params;
      params.count = count;
      params.seed = rng();
      params.stream = rng() % 1000;
      params.bound = 0.0346f;
      ExpectMatchesHostTwin(params, offset);
    }
  }
}

TEST(RandomFillOpTest, LargeFillUsesGridStrideAndMatchesHostTwin) {
  // More runs of 8 than 8192 blocks x 256 threads cover in one pass.
  RandomFillParams params;
  params.count = (int64_t{8192} * 256 * 8) * 2 + 13;
  params.seed = gpu_test::FreshRng()();
  params.bound = 1.f;
  params.center = 0.5f;
  ExpectMatchesHostTwin(params, 0);
}

TEST(RandomFillOpTest, SameInputsSameValuesOtherSeedOrStreamOtherValues) {
  const int64_t count = 100003;
  RandomFillParams params;
  params.count = count;
  params.seed = gpu_test::FreshRng()();
  params.stream = 5;
  params.bound = 0.5f;
  auto fill = [&](const RandomFillParams& p) {
    auto buffer = Poisoned<__nv_bfloat16>(static_cast<size_t>(count));
    RandomFillParams q = p;
    q.out = buffer.data();
    EXPECT_TRUE(RandomFill(q, nullptr).ok());
    return FromBf16(Download(buffer));
  };
  const std::vector<float> a = fill(params);
  EXPECT_EQ(a, fill(params));
  RandomFillParams other_seed = params;
  other_seed.seed += 1;
  RandomFillParams other_stream = params;
  other_stream.stream += 1;
  for (const RandomFillParams& p : {other_seed, other_stream}) {
    const std::vector<float> b = fill(p);
    int64_t equal = 0;
    for (int64_t i = 0; i < count; ++i)
      equal += a[static_cast<size_t>(i)] == b[static_cast<size_t>(i)];
    // Independent values in bf16 coincide rarely (about 1 in a few hundred).
    EXPECT_LT(equal, count / 50) << "seed " << p.seed << " stream " << p.stream;
  }
}

TEST(RandomFillOpTest, RangeMeanAndVarianceOfAUniform) {
  const int64_t count = 1 << 22;
  const float bound = std::sqrt(3.f) * 0.02f;  // the weights' std 0.02
  auto buffer = Poisoned<__nv_bfloat16>(static_cast<size_t>(count));
  RandomFillParams params;
  params.out = buffer.data();
  params.count = count;
  params.seed = gpu_test::FreshRng()();
  params.bound = bound;
  ASSERT_STATUS_OK(RandomFill(params, nullptr));
  const std::vector<float> values = FromBf16(Download(buffer));
  double sum = 0, sum_sq = 0, lo = 1e30, hi = -1e30;
  for (float v : values) {
    sum += v;
    sum_sq += double(v) * v;
    lo = std::min(lo, double(v));
    hi = std::max(hi, double(v));
  }
  // bf16 rounding of a value within bound can round up to the bf16 above bound.
  const double bound_bf16 = Bf16ToF32(F32ToBf16(bound));
  EXPECT_GE(lo, -bound_bf16);
  EXPECT_LE(hi, bound_bf16);
  EXPECT_LT(lo, -0.99 * bound);  // the range is covered
  EXPECT_GT(hi, 0.99 * bound);
  const double mean = sum / count;
  const double variance = sum_sq / count - mean * mean;
  const double want_variance = double(bound) * bound / 3;  // = 0.02^2
  std::cout << "[ stats     ] mean " << mean << " variance " << variance << " (want "
            << want_variance << ")\n";
  // Standard error of the mean: bound / sqrt(3 count) ~ 1e-5; 6 sigma.
  EXPECT_LT(std::fabs(mean), 6 * bound / std::sqrt(3.0 * count));
  EXPECT_NEAR(variance, want_variance, 0.01 * want_variance);
}

TEST(RandomFillOpTest, ZeroBoundFillsTheConstant) {
  const int64_t count = 4099;
  auto buffer = Poisoned<__nv_bfloat16>(static_cast<size_t>(count));
  RandomFillParams params;
  params.out = buffer.data();
  params.count = count;
  params.center = 1.f;
  ASSERT_STATUS_OK(RandomFill(params, nullptr));
  for (float v : FromBf16(Download(buffer))) ASSERT_EQ(v, 1.f);
}

TEST(RandomFillOpTest, RejectsBadParams) {
  auto buffer = Poisoned<__nv_bfloat16>(16);
  RandomFillParams good;
  good.out = buffer.data();
  good.count = 16;
  good.bound = 1.f;
  EXPECT_TRUE(RandomFill(good, nullptr).ok());

  auto expect_invalid = [&](RandomFillParams p, const std::string& mentions) {
    const Status s = RandomFill(p, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(mentions), std::string::npos) << s.message();
  };
  RandomFillParams p = good;
  p.out = nullptr;
  expect_invalid(p, "out");
  p = good;
  p.count = -1;
  expect_invalid(p, "count");
  p = good;
  p.bound = -1.f;
  expect_invalid(p, "bound");
  p = good;
  p.bound = INFINITY;
  expect_invalid(p, "bound");
  p = good;
  p.center = NAN;
  expect_invalid(p, "center");
  p = good;
  p.out = nullptr;
  p.count = 0;  // nothing to write: fine
  EXPECT_TRUE(RandomFill(p, nullptr).ok());
}

}  // namespace
}  // namespace rubato::cuda
