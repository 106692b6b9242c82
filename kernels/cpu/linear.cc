// Linear layer through OpenBLAS (see linear.h).
//
// Like torch's addmm, the bias is the initial value of the accumulator (sgemm with beta = 1)
// rather than added afterwards, so rounding follows the same order.
#include "kernels/cpu/linear.h"

#include <cblas.h>

#include <algorithm>
#include <cstddef>

namespace rubato {

void Linear(const float* x, const float* weight, const float* bias, int rows, int in_features,
            int out_features, float* y) {
  if (rows == 0 || out_features == 0) return;
  float beta = 0.0f;
  if (bias != nullptr) {
    for (int r = 0; r < rows; ++r) {
      std::copy(bias, bias + out_features, y + static_cast<size_t>(r) * out_features);
    }
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out_features, in_features,
              /*alpha=*/1.0f, x, /*lda=*/in_features, weight, /*ldb=*/in_features, beta, y,
              /*ldc=*/out_features);
}

}  // namespace rubato
