// Numerically stable softmax over one row, fp32.
#pragma once

namespace rubato {

// x: [count], f32, replaced by softmax(x): exp(x - max) / sum. count >= 1. Entries equal to
// -inf become 0 (masking); at least one entry must be finite.
void SoftmaxInPlace(float* x, int count);

// SoftmaxInPlace that also returns the log-sum-exp of the input, max + log(sum), in double.
double SoftmaxInPlaceWithLse(float* x, int count);

}  // namespace rubato
