// Tests for dtype names and f32 <-> bf16/f16 conversions.
#include "common/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace rubato {
namespace {

TEST(DType, ParsesNamesAndRejectsUnknown) {
  EXPECT_EQ(*ParseDTypeName("bf16"), DType::kBF16);
  EXPECT_EQ(*ParseDTypeName("float16"), DType::kF16);
  EXPECT_EQ(*ParseDTypeName("f32"), DType::kF32);
  auto bad = ParseDTypeName("f8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'f8'"), std::string::npos);
}

TEST(DType, SafetensorsTagsDistinguishUnsupportedFromUnknown) {
  EXPECT_EQ(*ParseSafetensorsDType("BF16"), DType::kBF16);
  EXPECT_EQ(ParseSafetensorsDType("F64").status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(ParseSafetensorsDType("Q7").status().code(), StatusCode::kInvalidArgument);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(F32ToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even): rounds up.
  EXPECT_EQ(F32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(Bf16ToF32(F32ToBf16(-2.5f)), -2.5f);
}

TEST(DType, F16RoundTripsEveryFiniteHalf) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = F16ToF32(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f))));
      continue;
    }
    ASSERT_EQ(F32ToF16(f), h) << "half bits 0x" << std::hex << bits;
  }
}

TEST(DType, F16KnownValuesAndOverflow) {
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // rounds to inf
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // halfway to smallest subnormal: even
  EXPECT_EQ(F32ToF16(std::ldexp(1.5f, -25)), 0x0001);
}

TEST(DType, BulkConversionMatchesScalar) {
  const float src[5] = {0.0f, -1.25f, 3.14159f, 1e-3f, 60000.0f};
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    unsigned char packed[20];
    float back[5];
    ConvertFromF32(dtype, src, packed, 5);
    ConvertToF32(dtype, packed, back, 5);
    for (int i = 0; i < 5; ++i) {
      const float tol = dtype == DType::kF32 ? 0.0f : std::fabs(src[i]) * 8e-3f;
      EXPECT_NEAR(back[i], src[i], tol) << DTypeName(dtype) << " element " << i;
    }
  }
}

// An empty tensor converts through null pointers (an empty std::vector's data()): nothing may be
// read or written, and memcpy must not see them (undefined even for 0 bytes; the sanitizer pass
// of scripts/test fails on it).
TEST(DType, BulkConversionOfNothingPassesNoNullPointerToMemcpy) {
  std::vector<float> empty;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    ConvertToF32(dtype, nullptr, empty.data(), 0);
    ConvertFromF32(dtype, empty.data(), nullptr, 0);
  }
  EXPECT_TRUE(empty.empty());
}

}  // namespace
}  // namespace rubato
