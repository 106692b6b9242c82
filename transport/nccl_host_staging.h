// Host memory over NCCL (DESIGN §3 "Transport"): a Transport that takes host buffers and moves
// them GPU to GPU through an NcclTransport, staging each one through device memory on the NCCL
// stream. What it is for: the layer-pack protocol's packs and replies are host buffers on both
// sides today (the cache client writes packs on the host, the cache service stores host or
// pinned memory), so this is how they cross between two GPUs by NCCL (NVLink / PCIe P2P)
// instead of UCX. Device buffers pass straight through to NCCL.
//
//   RUBATO_ASSIGN_OR_RETURN(auto nccl, NcclTransport::Create({...}));
//   RUBATO_ASSIGN_OR_RETURN(auto staged, NcclHostStagingTransport::Create(std::move(nccl)));
//   staged->Post({TransferOp::Send(peer, tag, host_pack.data(), host_pack.size())});
//
// Per Post, on the NCCL stream, in order: each host send is copied into pinned memory (on the
// calling thread) and from there to a device staging buffer; the NCCL group; each host receive
// is copied device -> pinned; an event. Test / Wait report a group done when that event has
// passed, and only then copy the received bytes into the caller's buffers (so a caller buffer
// is written by this thread, never by the GPU). Staging buffers come from a pool by size class
// and go back to it when their group completes.
//
// The costs (host copies both ways and one stream for everything) are the price of keeping the
// packs in host memory; device-resident packs, which NCCL could send without staging, are not
// built. One NCCL stream also means groups run one after another: a posted receive (a reply not
// yet sent) holds back the sends posted after it, so packs pipeline less than over UCX. The
// failure rules are NcclTransport's: Cancel of a group in flight aborts the communicator.
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
