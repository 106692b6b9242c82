// MakePinnedKvStorageAllocator (pinned_kv_storage.h): cudaHostAlloc / cudaFreeHost.
#include "cache_rank/pinned_kv_storage.h"

#include <cuda_runtime_api.h>

#include <string>

namespace rubato {
namespace {

class PinnedKvStorageAllocator final : public KvStorageAllocator {
 public:
  explicit PinnedKvStorageAllocator(int device) : device_(device) {}

  std::string_view name() const override { return "pinned"; }

  Result<std::byte*> Allocate(uint64_t bytes) override {
    // The allocating thread (an RPC handler's) may have no device yet: CUDA would make GPU 0's
    // context for it, on another rank's GPU.
    const cudaError_t selected = cudaSetDevice(device_);
    if (selected != cudaSuccess) {
      return UnavailableError("pinned KV storage: selecting device " + std::to_string(device_) +
                              ": " + cudaGetErrorString(selected));
    }
    void* data = nullptr;
    // cudaHostAlloc returns page-aligned memory (well past the 64 bytes the store needs).
    const cudaError_t error = cudaHostAlloc(&data, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
    if (error == cudaErrorMemoryAllocation) {
      return ResourceExhaustedError("pinned KV storage: cudaHostAlloc of " +
                                    std::to_string(bytes) + " bytes failed (out of memory)");
    }
    if (error != cudaSuccess) {
      return UnavailableError("pinned KV storage: cudaHostAlloc of " + std::to_string(bytes) +
                              " bytes failed: " + cudaGetErrorString(error));
    }
    return static_cast<std::byte*>(data);
  }

  void Free(std::byte* data, uint64_t /*bytes*/) override {
    if (data != nullptr) (void)cudaFreeHost(data);
  }

 private:
  const int device_;
};

}  // namespace

std::shared_ptr<KvStorageAllocator> MakePinnedKvStorageAllocator(int device) {
  return std::make_shared<PinnedKvStorageAllocator>(device);
}

}  // namespace rubato
