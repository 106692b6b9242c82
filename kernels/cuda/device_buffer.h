// DeviceBuffer<T>: an owning, move-only cudaMalloc'd array (docs/design.md §10: expensive copies
// are explicit calls, never a copy constructor). Used by the CUDA model, the GPU tests and the
// benchmarks.
//
//   RUBATO_ASSIGN_OR_RETURN(auto keys, DeviceBuffer<__nv_bfloat16>::Allocate(n, "K pool"));
//   RUBATO_RETURN_IF_ERROR(keys.CopyFromHost(host.data(), host.size(), stream));
#pragma once

#include <cuda_runtime_api.h>

#include <bit>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"
#include "kernels/cuda/cuda_status.h"

namespace rubato::cuda {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { Reset(); }

  // `count` elements, uninitialized. ResourceExhausted names `what` and the bytes asked for.
  static Result<DeviceBuffer> Allocate(size_t count, std::string_view what) {
    DeviceBuffer buffer;
    if (count == 0) return buffer;
    void* pointer = nullptr;
    const cudaError_t error = cudaMalloc(&pointer, count * sizeof(T));
    if (error != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free allocation error
      return CudaStatus(error, "allocating " + std::to_string(count * sizeof(T)) +
                                   " bytes of device memory for " + std::string(what));
    }
    buffer.data_ = static_cast<T*>(pointer);
    buffer.size_ = count;
    return buffer;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

  // Copies `count` <= size() elements; asynchronous on `stream` (host memory must stay valid
  // until the stream reaches the copy; pageable memory makes it effectively synchronous).
  Status CopyFromHost(const T* host, size_t count, cudaStream_t stream) {
    if (count > size_) return InvalidArgumentError("DeviceBuffer::CopyFromHost: too many elements");
    return CudaStatus(cudaMemcpyAsync(data_, host, count * sizeof(T), cudaMemcpyHostToDevice, stream),
                      "copying to the device");
  }
  Status CopyToHost(T* host, size_t count, cudaStream_t stream) const {
    if (count > size_) return InvalidArgumentError("DeviceBuffer::CopyToHost: too many elements");
    return CudaStatus(cudaMemcpyAsync(host, data_, count * sizeof(T), cudaMemcpyDeviceToHost, stream),
                      "copying to the host");
  }

 private:
  void Reset() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  size_t size_ = 0;
};

// Grows `buffer` to at least `count` elements, a power of two (growing workloads reallocate
// rarely); keeps it when it is large enough. Contents are not kept.
template <typename T>
Status GrowTo(DeviceBuffer<T>& buffer, size_t count, std::string_view what) {
  if (count <= buffer.size()) return Status::Ok();
  buffer = DeviceBuffer<T>();  // free first: the old and new buffers need not coexist
  RUBATO_ASSIGN_OR_RETURN(buffer, DeviceBuffer<T>::Allocate(std::bit_ceil(count), what));
  return Status::Ok();
}

// Allocates max(count, 1) elements into `buffer` (so that an empty table still has a pointer
// a kernel argument can carry); the error names `what`.
template <typename T>
Status AllocateAtLeastOne(DeviceBuffer<T>& buffer, size_t count, const std::string& what) {
  auto allocated = DeviceBuffer<T>::Allocate(count > 0 ? count : 1, what);
  if (!allocated.ok()) return allocated.status();
  buffer = std::move(allocated).value();
  return Status::Ok();
}

}  // namespace rubato::cuda
