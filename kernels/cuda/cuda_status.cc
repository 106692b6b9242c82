// CUDA error codes -> rubato Status (cuda_status.h).
#include "kernels/cuda/cuda_status.h"

#include <string>

namespace rubato::cuda {

Status CudaStatus(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return Status::Ok();
  std::string message = std::string("CUDA: ") + std::string(what) + ": " +
                        cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")";
  switch (error) {
    case cudaErrorMemoryAllocation:
      return ResourceExhaustedError(std::move(message));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return UnavailableError(std::move(message));
    default:
      return InternalError(std::move(message));
  }
}

Status LaunchStatus(std::string_view kernel) {
  return CudaStatus(cudaGetLastError(), std::string("launching ") + std::string(kernel));
}

}  // namespace rubato::cuda
