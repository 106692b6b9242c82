// Row gather on the GPU: out[r][:] = in[row_indices[r]][:], bf16. The CUDA model uses it to pick
// the hidden rows whose logits a batch wants (one per decode entry, the last of a prefill chunk,
// every row of a kAll entry) before the lm_head GEMM, so the vocabulary projection runs on those
// rows only. CPU twin: a plain loop (tests/gpu/gather_rows_op_test.cc).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct GatherRowsParams {
  const __nv_bfloat16* in = nullptr;  // [in_rows][dim], bf16, row-major, 16-byte aligned
  int in_rows = 0;
  const int32_t* row_indices = nullptr;  // [rows], device: rows of `in`, in [0, in_rows)
  int rows = 0;
  int dim = 0;                   // a multiple of 8
  __nv_bfloat16* out = nullptr;  // [rows][dim], bf16, 16-byte aligned; must not overlap `in`
};

// An index outside [0, in_rows) (a caller bug; indices live on the device, so the launcher
// cannot check them) writes a row of NaN instead of reading out of bounds. rows == 0 is a no-op.
Status GatherRows(const GatherRowsParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
