// RMSNorm (see rmsnorm.h).
//
// transformers computes variance = x.pow(2).mean(-1) in fp32, then x * rsqrt(variance + eps),
// then weight * that. The squares are rounded to fp32 like torch's; the mean is accumulated in
// double so that the result is the correctly rounded fp32 mean (torch's pairwise fp32 sum is
// within a few ulp of it).
#include "kernels/cpu/rmsnorm.h"

#include <cmath>
#include <cstddef>

namespace rubato {

void RmsNorm(const float* x, const float* weight, int rows, int dim, float eps, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* row = x + static_cast<size_t>(r) * dim;
    float* out_row = out + static_cast<size_t>(r) * dim;
    double sum_squares = 0.0;
    for (int i = 0; i < dim; ++i) {
      const float square = row[i] * row[i];
      sum_squares += square;
    }
    const float mean_square = static_cast<float>(sum_squares / dim);
    const float inv_rms = 1.0f / std::sqrt(mean_square + eps);
    for (int i = 0; i < dim; ++i) out_row[i] = weight[i] * (row[i] * inv_rms);
  }
}

}  // namespace rubato
