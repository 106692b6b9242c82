// Host memory over NCCL: a Transport that takes host buffers (the layer-pack protocol's packs and
// replies) and moves them GPU to GPU through an NcclTransport, staging each through pinned and
// device memory on the NCCL stream; device buffers pass straight through. Received bytes reach
// the caller's buffers only in Test / Wait, on the calling thread. Failure rules are
// NcclTransport's. Narrative (the copies per Post, staging pool, costs): docs/transport.md
// "Host memory over NCCL".
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "transport/nccl_transport.h"
#include "transport/transport.h"

namespace rubato::transport {

class NcclHostStagingTransport final : public Transport {
 public:
  static Result<std::unique_ptr<NcclHostStagingTransport>> Create(
      std::unique_ptr<NcclTransport> nccl);
  ~NcclHostStagingTransport() override;

  NcclHostStagingTransport(const NcclHostStagingTransport&) = delete;
  NcclHostStagingTransport& operator=(const NcclHostStagingTransport&) = delete;

  std::string_view BackendName() const override { return "nccl"; }
  int Rank() const override { return nccl_->Rank(); }
  int WorldSize() const override { return nccl_->WorldSize(); }
  bool SupportsMemory(MemoryKind) const override { return true; }

  Result<TransferId> Post(std::span<const TransferOp> ops) override;
  Result<bool> Test(TransferId id) override;
  Status Wait(TransferId id, std::chrono::milliseconds timeout) override;
  void Cancel(TransferId id) override;
  // NCCL's byte counts (host and device transfers alike) and failures.
  TransportStats Stats() const override { return nccl_->Stats(); }

  // Staging memory the pool holds (device and pinned host alike), for tests and logs.
  uint64_t StagingBytes() const { return staging_bytes_; }

 private:
  // A device buffer and its pinned host twin of `capacity` bytes (a power of two).
  struct Staging {
    void* device = nullptr;
    void* pinned = nullptr;
    size_t capacity = 0;
  };
  // A host receive waiting for its bytes: where they are staged and where they go.
  struct HostReceive {
    Staging staging;
    void* into = nullptr;
    size_t bytes = 0;
  };
  struct Group {
    TransferId nccl_id = 0;
    bool nccl_done = false;
    void* copied = nullptr;  // cudaEvent_t after the receives' device -> pinned copies
    std::vector<Staging> sends;
    std::vector<HostReceive> receives;
  };

  explicit NcclHostStagingTransport(std::unique_ptr<NcclTransport> nccl)
      : nccl_(std::move(nccl)) {}
  Result<Staging> TakeStaging(size_t bytes);
  void GiveBack(Staging staging);
  // Returns the group's staging buffers to the pool (`reusable`) or frees them at the end
  // (after a failure the GPU may still touch them until the communicator is aborted).
  void Release(std::map<TransferId, Group>::iterator group, bool reusable);

  std::unique_ptr<NcclTransport> nccl_;
  std::multimap<size_t, Staging> free_;  // by capacity
  std::vector<Staging> retired_;         // freed in the destructor, after the abort
  uint64_t staging_bytes_ = 0;
  TransferId next_id_ = 1;
  std::map<TransferId, Group> groups_;
};

// The two ranks of a world of two in this process, rank r on devices[r] (two different GPUs),
// each wrapped for host memory: what joins a cache service to its client across two GPUs of one
// process (tests, benchmarks). Creates both communicators on threads of its own.
Result<std::array<std::unique_ptr<Transport>, 2>> CreateNcclHostStagingPair(
    std::array<int, 2> devices, std::chrono::milliseconds init_timeout = std::chrono::seconds(30));

}  // namespace rubato::transport
