// Storage dtype names and conversions (see dtype.h).
#include "common/dtype.h"

#include <array>
#include <string>

namespace rubato {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

Result<DType> ParseDTypeName(std::string_view name) {
  if (name == "f32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "f16" || name == "float16") return DType::kF16;
  return InvalidArgumentError("unknown dtype '" + std::string(name) +
                              "' (expected f32, bf16 or f16)");
}

Result<DType> ParseSafetensorsDType(std::string_view tag) {
  if (tag == "F32") return DType::kF32;
  if (tag == "BF16") return DType::kBF16;
  if (tag == "F16") return DType::kF16;
  static constexpr std::array<std::string_view, 13> kOtherValid = {
      "F64", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL", "F8_E4M3", "F8_E5M2",
      "F8_E8M0"};
  for (std::string_view other : kOtherValid) {
    if (tag == other) {
      return UnsupportedError("unsupported dtype '" + std::string(tag) +
                              "' (rubato reads F32, BF16 and F16 tensors)");
    }
  }
  return InvalidArgumentError("unknown dtype '" + std::string(tag) + "'");
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;  // +-0
    } else {        // subnormal: renormalize
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      mantissa &= 0x3ffu;
      bits = sign | (exponent << 23) | (mantissa << 13);
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf / NaN
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t F32ToF16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;                  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;                 // overflow (>= 65520) -> inf
  if (abs < 0x33000001u) return sign;                            // underflow to zero
  int32_t exponent = static_cast<int32_t>(abs >> 23) - 127 + 15;
  uint32_t mantissa = abs & 0x7fffffu;
  if (exponent <= 0) {  // subnormal half
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into exponent
  return sign | static_cast<uint16_t>(half);
}

void ConvertToF32(DType dtype, const void* src, float* dst, size_t count) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  switch (dtype) {
    case DType::kF32:
      // memcpy with a null pointer is undefined even for 0 bytes (an empty tensor's vector).
      if (count > 0) std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, 2);
        dst[i] = Bf16ToF32(bits);
      }
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, 2);
        dst[i] = F16ToF32(bits);
      }
      return;
  }
}

void ConvertFromF32(DType dtype, const float* src, void* dst, size_t count) {
  auto* bytes = static_cast<unsigned char*>(dst);
  switch (dtype) {
    case DType::kF32:
      // memcpy with a null pointer is undefined even for 0 bytes (an empty tensor's vector).
      if (count > 0) std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        const uint16_t bits = F32ToBf16(src[i]);
        std::memcpy(bytes + 2 * i, &bits, 2);
      }
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        const uint16_t bits = F32ToF16(src[i]);
        std::memcpy(bytes + 2 * i, &bits, 2);
      }
      return;
  }
}

}  // namespace rubato
