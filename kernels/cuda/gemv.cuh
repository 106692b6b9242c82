// Linear layers of a few rows at the copy bandwidth: y = x W^T (+ bias) for 1-4 rows of x, bf16
// in and out, fp32 accumulation: the decode step's weight-bound products, where cuBLASLt's
// kernels leave bandwidth unused at some shapes (docs/cuda_model.md "GEMV"). Same contract as
// CublasLtGemm::Linear (CPU twin: kernels/cpu/linear.h); CublasLtGemm::Linear calls it where
// GemvApplies says so.
#pragma once

#include <cuda_runtime_api.h>

#include "common/status.h"
#include "kernels/cuda/gemm.h"

namespace rubato::cuda {

inline constexpr int kGemvMaxRows = 4;

// Whether SmallRowsLinear takes `args`: 1..kGemvMaxRows rows, bf16 output, in_features a
// multiple of 8, 16-byte aligned x and weight, a weight of at least 8 MiB (below it a launch
// costs more than the bytes), and RUBATO_GEMV not "0".
bool GemvApplies(const LinearArgs& args);

Status SmallRowsLinear(const LinearArgs& args, cudaStream_t stream);

}  // namespace rubato::cuda
