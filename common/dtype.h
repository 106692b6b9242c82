// Storage dtypes rubato reads and computes with (f32, bf16, f16) and their conversions.
//
// Compute on the CPU backend is always fp32; bf16/f16 are storage formats. Conversions follow
// IEEE-754: f32 -> bf16/f16 rounds to nearest even, NaN stays NaN, f16 overflow becomes inf.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "common/status.h"

namespace rubato {

enum class DType : uint8_t { kF32, kBF16, kF16 };

// Bytes per element.
constexpr size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// Lower-case name used in configs and logs: "f32", "bf16", "f16".
std::string_view DTypeName(DType dtype);

// Parses a config/CLI name ("f32", "float32", "bf16", "bfloat16", "f16", "float16").
Result<DType> ParseDTypeName(std::string_view name);

// Parses a safetensors dtype tag ("F32", "BF16", "F16"). Other valid safetensors tags
// (F64, I32, U8, F8_E4M3, ...) are reported as unsupported, anything else as unknown.
Result<DType> ParseSafetensorsDType(std::string_view tag);

inline float Bf16ToF32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t F32ToBf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float F16ToF32(uint16_t bits);
uint16_t F32ToF16(float value);

// Converts `count` elements of `src` (in `dtype`) to fp32. src may be unaligned.
void ConvertToF32(DType dtype, const void* src, float* dst, size_t count);

// Converts `count` fp32 values to `dtype`.
void ConvertFromF32(DType dtype, const float* src, void* dst, size_t count);

}  // namespace rubato
