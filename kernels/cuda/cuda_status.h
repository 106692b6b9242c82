// CUDA errors as rubato Status values (docs/design.md §10 "Errors are values").
//
//   RUBATO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(...), "copying the block tables");
//   RUBATO_RETURN_IF_ERROR(LaunchStatus("decode_attention"));  // after a <<<...>>> launch
#pragma once

#include <cuda_runtime_api.h>

#include <string_view>

#include "common/status.h"

namespace rubato::cuda {

// Ok for cudaSuccess, else an error naming `what` and CUDA's description. Out-of-memory is
// ResourceExhausted, a missing device or driver Unavailable, everything else Internal.
Status CudaStatus(cudaError_t error, std::string_view what);

// The status of the last kernel launch on this thread (cudaGetLastError), naming `kernel`.
// Launch configuration errors show up here; faults inside the kernel show up at the next
// synchronizing call.
Status LaunchStatus(std::string_view kernel);

}  // namespace rubato::cuda

#define RUBATO_CUDA_RETURN_IF_ERROR(expr, what)                           \
  do {                                                                    \
    ::rubato::Status rubato_cuda_status_ =                                \
        ::rubato::cuda::CudaStatus((expr), (what));                       \
    if (!rubato_cuda_status_.ok()) return rubato_cuda_status_;            \
  } while (0)
