// DeviceScope: makes a CUDA device current for a scope and restores the caller's on exit, for
// code that drives two GPUs from one thread (the GPU cache rank of this process: the model's GPU
// and the cache GPU). The selection's error is kept for the caller to return.
//
//   DeviceScope scope(cache_device);
//   RUBATO_RETURN_IF_ERROR(scope.status());
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/status.h"
#include "kernels/cuda/cuda_status.h"

namespace rubato::cuda {

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    (void)cudaGetDevice(&previous_);
    status_ = CudaStatus(cudaSetDevice(device), "selecting device " + std::to_string(device));
  }
  ~DeviceScope() { (void)cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = 0;
  Status status_;
};

}  // namespace rubato::cuda
