// PinnedBuffer: an owning, move-only page-locked host allocation (cudaHostAlloc). The CUDA
// model stages each forward's inputs and its sampled token ids in pinned memory, so that the
// copies are truly asynchronous on the model's stream (pageable copies are staged by the driver
// and synchronize).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

#include "common/status.h"
#include "kernels/cuda/cuda_status.h"

namespace rubato {

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~PinnedBuffer() { Reset(); }

  // `bytes` of page-locked host memory, uninitialized; `what` names it in errors.
  static Result<PinnedBuffer> Allocate(size_t bytes, const std::string& what) {
    PinnedBuffer buffer;
    if (bytes == 0) return buffer;
    void* pointer = nullptr;
    const cudaError_t error = cudaHostAlloc(&pointer, bytes, cudaHostAllocDefault);
    if (error != cudaSuccess) {
      cudaGetLastError();
      return cuda::CudaStatus(error, "allocating " + std::to_string(bytes) +
                                         " bytes of pinned host memory for " + what);
    }
    buffer.data_ = static_cast<std::byte*>(pointer);
    buffer.bytes_ = bytes;
    return buffer;
  }

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace rubato
