// RMSNorm as in Hugging Face LlamaRMSNorm / Qwen2RMSNorm / Qwen3RMSNorm, fp32:
//   out = weight * (x * rsqrt(mean(x^2) + eps))
#pragma once

namespace rubato {

// Normalizes each row of x over its last dimension.
//   x:      [rows][dim], f32
//   weight: [dim], f32
//   out:    [rows][dim], f32; may be the same pointer as x (in place)
void RmsNorm(const float* x, const float* weight, int rows, int dim, float eps, float* out);

}  // namespace rubato
