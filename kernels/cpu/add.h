// Residual add: x += y, elementwise, fp32 (the "residual" step after attention and the MLP).
#pragma once

#include <cstdint>

namespace rubato {

// x[i] += y[i] for i in [0, count). x and y: [count], f32; they must not overlap partially.
void AddInPlace(float* x, const float* y, int64_t count);

}  // namespace rubato
