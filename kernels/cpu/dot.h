// The fp32 dot product of the CPU attention ops (attention.cc, two_segment_attention.cc) and of
// the SFI slow step's logits (cpu_model_sfi.cc): one summation order shared by all of them, so
// that their scores round alike.
#pragma once

namespace rubato {

// a, b: [n], f32. Eight independent partial sums in a fixed order (results do not depend on the
// caller) that the compiler can keep in vector registers.
inline float Dot(const float* a, const float* b, int n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) partial[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) partial[i % 8] += a[i] * b[i];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

}  // namespace rubato
