// exp(x) in fp32 for softmax loops, written so that the compiler vectorizes a loop calling it
// (no libm call, no branch): Cephes' expf (range reduction by ln 2, degree-6 polynomial, scale by
// 2^n through the exponent bits). Error within 2 ulp of the correctly rounded result for
// x in [-87.3, 88.3]; x below that range returns exp(-87.3) ~ 1.2e-38 instead of a smaller
// number or 0, which no sum that includes exp(0) = 1 can see. NaN is not supported.
#pragma once

#include <bit>
#include <cstdint>

namespace rubato {

inline float ExpApprox(float x) {
  constexpr float kMin = -87.3f;  // 2^n stays a normal number
  constexpr float kMax = 88.3f;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kLn2Hi = 0.693359375f;      // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in 9 bits
  constexpr float kLn2Lo = -2.12194440e-4f;
  x = x < kMin ? kMin : x;
  x = x > kMax ? kMax : x;
  const float n = (x * kLog2e + kRoundMagic) - kRoundMagic;  // round(x / ln 2)
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;             // |r| <= ln(2) / 2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  return p * std::bit_cast<float>(exponent_bits);
}

}  // namespace rubato
