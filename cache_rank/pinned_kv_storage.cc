// MakePinnedKvStorageAllocator (pinned_kv_storage.h): cudaHostAlloc / cudaFreeHost.
#include "cache_rank/pinned_kv_storage.h"

#include <cuda_runtime_api.h>

#include <string>

namespace rubato {
namespace {

class PinnedKvStorageAllocator final : public KvStorageAllocator {
 public:
  std::string_view name() const override { return "pinned"; }

  Result<std::byte*> Allocate(uint64_t bytes) override {
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
};

}  // namespace

std::shared_ptr<KvStorageAllocator> MakePinnedKvStorageAllocator() {
  return std::make_shared<PinnedKvStorageAllocator>();
}

}  // namespace rubato
