// NCCL backend of the data-plane Transport (transport.h; DESIGN §3 "Transport"): GPU-to-GPU
// point-to-point transfers, each Post one ncclGroupStart/End of ncclSend/ncclRecv on a dedicated
// CUDA stream of the transport, completion tracked by a CUDA event recorded after the group.
//
//   // Rank 0 makes the id and gives it to the others (MPI broadcast or the RPC Hello):
//   RUBATO_ASSIGN_OR_RETURN(std::string id, NcclTransport::NewUniqueId());
//   RUBATO_ASSIGN_OR_RETURN(auto nccl, NcclTransport::Create({.unique_id = id, .rank = r,
//                                                             .world_size = 2, .device = 0}));
//
// What NCCL cannot do, and what this backend does about it:
// * Create, Post and the destructor make `device` current on the calling thread and leave it so
//   (restoring the caller's would be cudaSetDevice(0) on a thread that had none, creating a
//   context on GPU 0 in a cache rank that lives on GPU 1); callers that work on several GPUs
//   select theirs at every entry, as the CUDA model does.
// * Device memory only (`SupportsMemory(kHost)` is false; nccl_host_staging.h stages host
//   buffers through device memory).
// * Create is collective: it returns once every rank joined and every pair of ranks exchanged a
//   byte (so no later Post waits for NCCL's lazy connection setup).
// * NCCL does not see message sizes: a receive larger or smaller than its send is undefined
//   behaviour in NCCL, not an error. The layer-pack protocol gives both sides every size from
//   the session, so a mismatch is a caller bug; this backend cannot detect it.
// * A posted NCCL operation cannot be taken back, and a dead peer is never reported by the
//   operation itself (it spins). The communicator is created non-blocking so that it can be
//   aborted: Wait's timeout returns kDeadlineExceeded, and Cancel (or an asynchronous NCCL error)
//   aborts the communicator; every later call then returns kUnavailable. The RPC heartbeat is
//   what tells the caller that the peer is gone.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "transport/transport.h"

namespace rubato::transport {

struct NcclTransportOptions {
  std::string unique_id;  // NewUniqueId()'s bytes, the same on every rank
  int rank = 0;           // [0, world_size)
  int world_size = 2;     // >= 2
  int device = 0;         // CUDA device of this rank's buffers and stream
  // How long Create waits for every rank to join before it gives up (kDeadlineExceeded).
  std::chrono::milliseconds init_timeout{30000};
  // When set, Create gives up (kUnavailable) as soon as it reads true: another thread learned
  // that the other ranks will not come (the RPC Hello that carried the id failed).
  const std::atomic<bool>* give_up = nullptr;
};

class NcclTransport final : public Transport {
 public:
  // A fresh ncclUniqueId as bytes (rank 0 makes it; the others receive it out of band).
  static Result<std::string> NewUniqueId();

  static Result<std::unique_ptr<NcclTransport>> Create(const NcclTransportOptions& options);
  ~NcclTransport() override;

  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  std::string_view BackendName() const override { return "nccl"; }
  int Rank() const override { return rank_; }
  int WorldSize() const override { return world_size_; }
  int Device() const { return device_; }
  bool SupportsMemory(MemoryKind memory) const override { return memory == MemoryKind::kCuda; }

  Result<TransferId> Post(std::span<const TransferOp> ops) override;
  Result<bool> Test(TransferId id) override;
  Status Wait(TransferId id, std::chrono::milliseconds timeout) override;
  void Cancel(TransferId id) override;
  TransportStats Stats() const override { return stats_; }

  // The dedicated stream every group runs on (a consumer stream can wait on DoneEvent instead
  // of a host Wait).
  void* Stream() const { return stream_; }
  // The cudaEvent_t recorded after the group `id`, or null for an unknown id. Valid until the
  // group is released by Test / Wait / Cancel.
  void* DoneEvent(TransferId id) const;

 private:
  struct Group {
    void* done = nullptr;  // cudaEvent_t
    uint64_t bytes_sent = 0;
    uint64_t bytes_received = 0;
  };

  NcclTransport() = default;
  // Exchanges a byte with every other rank so that NCCL sets up every peer connection now.
  // NCCL connects a peer lazily, at the first group that names it, and that group cannot finish
  // before the peer joins in; a cache rank's first receive would otherwise wait (and block its
  // thread) until the inference rank's first pack, however late that comes.
  Status ConnectPeers(std::chrono::milliseconds timeout, const std::atomic<bool>* give_up);
  // kUnavailable once the communicator is aborted, else the communicator's asynchronous error.
  Status Health();
  // Marks the transport failed with `why` and aborts the communicator (idempotent).
  void Fail(Status why);
  void Release(std::map<TransferId, Group>::iterator group, bool completed);

  int rank_ = 0;
  int world_size_ = 0;
  int device_ = 0;
  void* comm_ = nullptr;    // ncclComm_t
  void* stream_ = nullptr;  // cudaStream_t
  Status failed_;           // ok until the communicator is aborted
  TransferId next_id_ = 1;
  std::map<TransferId, Group> groups_;
  TransportStats stats_;
};

}  // namespace rubato::transport
