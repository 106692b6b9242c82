// Host memory for the cache rank's KV store (see kv_storage.h).
#include "cache_rank/kv_storage.h"

#include <new>
#include <utility>

#include <fmt/format.h>

namespace rubato {
namespace {

constexpr std::align_val_t kAlignment{64};

class HostKvStorageAllocator final : public KvStorageAllocator {
 public:
  std::string_view name() const override { return "host"; }

  Result<std::byte*> Allocate(uint64_t bytes) override {
    if (bytes == 0) bytes = 1;  // a distinct, freeable pointer
    void* data = ::operator new(static_cast<size_t>(bytes), kAlignment, std::nothrow);
    if (data == nullptr) {
      return ResourceExhaustedError(
          fmt::format("kv storage: host memory refused an allocation of {} bytes", bytes));
    }
    return static_cast<std::byte*>(data);
  }

  void Free(std::byte* data, uint64_t /*bytes*/) override {
    ::operator delete(data, kAlignment);
  }
};

}  // namespace

std::shared_ptr<KvStorageAllocator> MakeHostKvStorageAllocator() {
  return std::make_shared<HostKvStorageAllocator>();
}

Result<SessionKvStorage> SessionKvStorage::Allocate(std::shared_ptr<KvStorageAllocator> allocator,
                                      uint64_t bytes) {
  if (allocator == nullptr) return InvalidArgumentError("kv storage: no allocator given");
  RUBATO_ASSIGN_OR_RETURN(std::byte* data, allocator->Allocate(bytes));
  SessionKvStorage storage;
  storage.allocator_ = std::move(allocator);
  storage.data_ = data;
  storage.bytes_ = bytes;
  return storage;
}

SessionKvStorage::SessionKvStorage(SessionKvStorage&& other) noexcept
    : allocator_(std::move(other.allocator_)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

SessionKvStorage& SessionKvStorage::operator=(SessionKvStorage&& other) noexcept {
  if (this != &other) {
    Release();
    allocator_ = std::move(other.allocator_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

SessionKvStorage::~SessionKvStorage() { Release(); }

void SessionKvStorage::Release() {
  if (data_ != nullptr) allocator_->Free(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace rubato
