// Linear layers on the GPU through cuBLASLt: y = x W^T (+ bias), bf16 inputs, fp32
// accumulation, bf16 or fp32 output. CPU twin: kernels/cpu/linear.h.
//
// One CublasLtGemm per stream owner (model); it keeps the handle, a workspace and the chosen
// algorithm per shape, so that repeated shapes (every decode step) skip the heuristic query and
// the calls can be captured in a CUDA graph.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "common/dtype.h"
#include "common/status.h"

namespace rubato::cuda {

struct LinearArgs {
  const __nv_bfloat16* x = nullptr;       // [rows][in_features], bf16, row-major
  const __nv_bfloat16* weight = nullptr;  // [out_features][in_features], bf16 (nn.Linear layout)
  const __nv_bfloat16* bias = nullptr;    // [out_features], bf16, or nullptr
  void* y = nullptr;                      // [rows][out_features], y_dtype
  DType y_dtype = DType::kBF16;           // kBF16 or kF32
  int rows = 0;
  int in_features = 0;
  int out_features = 0;
};

class CublasLtGemm {
 public:
  static Result<std::unique_ptr<CublasLtGemm>> Create(size_t workspace_bytes = 32u << 20);
  virtual ~CublasLtGemm() = default;

  // Asynchronous on `stream`; rows == 0 is a no-op.
  virtual Status Linear(const LinearArgs& args, cudaStream_t stream) = 0;
};

}  // namespace rubato::cuda
