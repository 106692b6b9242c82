// Softmax (see softmax.h). Like torch's CPU kernel: subtract the max, exponentiate in fp32,
// multiply by the reciprocal of the sum. The sum is accumulated in double (order-independent to
// well below fp32 rounding).
#include "kernels/cpu/softmax.h"

#include <cmath>

namespace rubato {

void SoftmaxInPlace(float* x, int count) { SoftmaxInPlaceWithLse(x, count); }

double SoftmaxInPlaceWithLse(float* x, int count) {
  float max_value = x[0];
  for (int i = 1; i < count; ++i) max_value = x[i] > max_value ? x[i] : max_value;
  double sum = 0.0;
  for (int i = 0; i < count; ++i) {
    x[i] = std::exp(x[i] - max_value);
    sum += x[i];
  }
  const float inv_sum = 1.0f / static_cast<float>(sum);
  for (int i = 0; i < count; ++i) x[i] *= inv_sum;
  return static_cast<double>(max_value) + std::log(sum);
}

}  // namespace rubato
