// RoPE (see rope.h).
//
// The inverse frequencies emulate torch's fp32 op sequence one operation at a time, because a
// one-ulp difference in inv_freq grows with the position (at position 100k it is a visible
// angle error). Notes on torch semantics that matter here:
//   * `scalar / tensor` is `tensor.reciprocal() * scalar` (Tensor.__rtruediv__), two roundings;
//   * Python float scalars are rounded to fp32 before fp32 tensor arithmetic;
//   * `theta ** t` is an fp32 pow; we evaluate it in double and round once, which is what an
//     exact fp32 pow returns (torch's is within an ulp of it).
#include "kernels/cpu/rope.h"

#include <cmath>
#include <cstddef>
#include <numbers>

namespace rubato {
namespace {

float Fp32Pow(float base, float exponent) {
  return static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
}

float Reciprocal(float x) { return 1.0f / x; }

// transformers' _compute_llama3_parameters applied to one default inverse frequency.
float Llama3ScaledInverseFrequency(float inv_freq, const RopeScaling& scaling) {
  const float factor = static_cast<float>(scaling.factor);
  const double old_context_len = scaling.original_max_position_embeddings;
  // Python floats: old_context_len / low_freq_factor and / high_freq_factor.
  const float low_freq_wavelen = static_cast<float>(old_context_len / scaling.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_context_len / scaling.high_freq_factor);

  // wavelen = 2 * math.pi / inv_freq
  const float wavelen = Reciprocal(inv_freq) * static_cast<float>(2.0 * std::numbers::pi);
  // inv_freq_llama = where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  const float inv_freq_llama = wavelen > low_freq_wavelen ? inv_freq / factor : inv_freq;
  // smooth_factor = (old_context_len / wavelen - low_freq_factor)
  //                 / (high_freq_factor - low_freq_factor)
  const float smooth_factor =
      (Reciprocal(wavelen) * static_cast<float>(old_context_len) -
       static_cast<float>(scaling.low_freq_factor)) /
      static_cast<float>(scaling.high_freq_factor - scaling.low_freq_factor);
  // smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
  const float smoothed =
      (1.0f - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
  const bool is_medium_freq = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
  return is_medium_freq ? smoothed : inv_freq_llama;
}

}  // namespace

std::vector<float> RopeInverseFrequencies(int head_dim, double rope_theta,
                                          const RopeScaling& scaling) {
  const int half = head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  const float theta = static_cast<float>(rope_theta);
  for (int i = 0; i < half; ++i) {
    // torch.arange(0, dim, 2).float() / dim
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    // 1.0 / (base ** exponent)
    float value = Reciprocal(Fp32Pow(theta, exponent));
    if (scaling.type == RopeScaling::Type::kLlama3) {
      value = Llama3ScaledInverseFrequency(value, scaling);
    }
    inv_freq[static_cast<size_t>(i)] = value;
  }
  return inv_freq;
}

void RopeCosSin(std::span<const int> positions, std::span<const float> inv_freq, float* cos,
                float* sin) {
  const size_t half = inv_freq.size();
  for (size_t t = 0; t < positions.size(); ++t) {
    const float position = static_cast<float>(positions[t]);
    for (size_t i = 0; i < half; ++i) {
      const float angle = position * inv_freq[i];
      // cos/sin of the fp32 angle, correctly rounded to fp32.
      cos[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
}

void ApplyRope(float* x, int tokens, int heads, int head_dim, const float* cos, const float* sin) {
  const int half = head_dim / 2;
  for (int t = 0; t < tokens; ++t) {
    const float* c = cos + static_cast<size_t>(t) * half;
    const float* s = sin + static_cast<size_t>(t) * half;
    for (int h = 0; h < heads; ++h) {
      float* v = x + (static_cast<size_t>(t) * heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float x1 = v[i];
        const float x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  }
}

}  // namespace rubato
