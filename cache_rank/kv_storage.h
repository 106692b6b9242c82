// Where the cache rank's KV lives: the allocator hook behind every session's storage.
//
// A session's K and V are one contiguous allocation (layout in kv_store.h). The store asks a
// KvStorageAllocator for it, so pinned host memory (cudaHostAlloc, for GPU DMA) can replace
// plain host memory later without touching the store. The store's operations (append, gather,
// top-k) read and write the allocation with the CPU, so an allocator must return
// host-addressable memory; device memory would need device versions of those operations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "common/status.h"

namespace rubato {

class KvStorageAllocator {
 public:
  virtual ~KvStorageAllocator() = default;
  // For logs and errors: "host", "pinned", ...
  virtual std::string_view name() const = 0;
  // `bytes` of host-addressable memory aligned to 64 bytes (contents unspecified), or
  // kResourceExhausted naming the size when the memory cannot be had.
  virtual Result<std::byte*> Allocate(uint64_t bytes) = 0;
  // Returns memory from Allocate with the same size.
  virtual void Free(std::byte* data, uint64_t bytes) = 0;
};

// Plain pageable host memory (operator new, 64-byte aligned). Thread-safe.
std::shared_ptr<KvStorageAllocator> MakeHostKvStorageAllocator();

// One allocation owned: freed by the allocator that made it when this is destroyed.
class SessionKvStorage {
 public:
  SessionKvStorage() = default;
  static Result<SessionKvStorage> Allocate(std::shared_ptr<KvStorageAllocator> allocator,
                                    uint64_t bytes);
  SessionKvStorage(SessionKvStorage&& other) noexcept;
  SessionKvStorage& operator=(SessionKvStorage&& other) noexcept;
  SessionKvStorage(const SessionKvStorage&) = delete;
  SessionKvStorage& operator=(const SessionKvStorage&) = delete;
  ~SessionKvStorage();

  std::byte* data() const { return data_; }
  uint64_t size() const { return bytes_; }

 private:
  void Release();

  std::shared_ptr<KvStorageAllocator> allocator_;
  std::byte* data_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace rubato
