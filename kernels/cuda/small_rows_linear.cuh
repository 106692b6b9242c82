// y = x W^T (+ bias) for a few rows (a decode step's batch): the weights are streamed once at the
// copy bandwidth by plain vector loads, where a tiled GEMM at M <= 8 leaves most of the card's
// bandwidth unused. Same contract as CublasLtGemm::Linear (kernels/cuda/gemm.h) and the CPU twin
// kernels/cpu/linear.h: bf16 x and W, fp32 accumulation, bf16 or fp32 y. CublasLtGemm takes this
// path by itself when SmallRowsLinearApplies. docs/design.md §5 "Linear layers".
#pragma once

#include <cuda_runtime_api.h>

#include "common/status.h"
#include "kernels/cuda/gemm.h"

namespace rubato::cuda {

// The most rows the kernel takes.
inline constexpr int kSmallRowsMax = 8;

// Whether `args` (already valid for Linear) suit the kernel: 1 <= rows <= kSmallRowsMax,
// in_features a multiple of 8, x and weight 16-byte aligned.
bool SmallRowsLinearApplies(const LinearArgs& args);

// Enqueues the kernel on `stream`; the caller checked SmallRowsLinearApplies.
Status SmallRowsLinear(const LinearArgs& args, cudaStream_t stream);

}  // namespace rubato::cuda
