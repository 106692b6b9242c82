// Linear layer y = x W^T + b (torch.nn.Linear) as one cblas_sgemm over all rows of x.
#pragma once

namespace rubato {

//   x:      [rows][in_features], f32
//   weight: [out_features][in_features], f32 (the Hugging Face layout of nn.Linear.weight)
//   bias:   [out_features], f32, or nullptr
//   y:      [rows][out_features], f32; must not overlap x or weight
// rows == 0 is a no-op.
void Linear(const float* x, const float* weight, const float* bias, int rows, int in_features,
            int out_features, float* y);

}  // namespace rubato
