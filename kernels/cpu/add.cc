// Residual add (see add.h).
#include "kernels/cpu/add.h"

namespace rubato {

void AddInPlace(float* x, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] += y[i];
}

}  // namespace rubato
