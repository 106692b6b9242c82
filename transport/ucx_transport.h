// The UCX Transport (DESIGN §3 "Transport"): UCP's tag API between processes, host memory
// everywhere and CUDA memory where the UCX runtime has CUDA support.
//
//   RUBATO_ASSIGN_OR_RETURN(auto ucx, UcxTransport::Create(rank, world_size));
//   std::vector<std::byte> mine = ucx->LocalAddress();      // give it to every peer (RPC, MPI)
//   RUBATO_RETURN_IF_ERROR(ucx->Connect(peer, peer_address)); // for each peer this rank sends to
//
// One UCP context and one worker per transport (thread mode single: one thread drives it, as
// transport.h says). Progress happens only inside Test, Wait, Cancel and the destructor; Wait
// polls the worker (yielding the CPU between polls) rather than sleeping on an event.
//
// Which UCX transports carry the bytes is UCX's own environment, read when Create runs:
//   UCX_TLS=tcp          TCP sockets (between hosts or pods); a dead peer is noticed at once
//   UCX_TLS=posix,self   shared memory between processes of one host (sysv,self works too;
//                        both run in a Docker container as root; cma carries no messages)
//   UCX_TLS=cuda_copy,cuda_ipc,...  device buffers, where the runtime has CUDA support (the
//                        GPU machine's UCX, Ubuntu libucx0 1.16.0, has no CUDA module:
//                        SupportsMemory(kCuda) is false there, checked; NCCL moves device data)
// unset: UCX picks among everything it finds. UCX_NET_DEVICES restricts the network devices.
// With UCX 1.13 and 1.16 the shared-memory transports cannot detect a lost peer, so error
// mode PEER finds no transport over them: Connect then falls back to mode NONE with a warning,
// and a dead peer shows only as Wait timeouts (the RPC heartbeat notices it). Adding tcp
// (sm,self,tcp) keeps detection but, seen with UCX 1.13, moves every lane to TCP on loopback.
//
// Wire tags: the sender's rank in the top 16 bits and the 48-bit user tag below; receives
// match the full 64 bits, so a transfer is matched by (source, tag) and, as UCX keeps order per
// (sender, tag), delivered in order. World size is at most 65536.
//
// Endpoints use UCX's error handling mode PEER where a transport supports it: when UCX
// notices a peer is gone (a TCP reset, a keepalive timeout), the peer's sends fail, its pending
// receives fail with kUnavailable and later Posts with it are refused; Wait's timeout bounds
// everything UCX has not noticed. RUBATO_LOG_SUBSYS=transport=debug logs each endpoint's lanes.
//
// Not supported yet: `ready_event` on device sends (UCX has no stream ordering: synchronize
// the event before Post); such ops are refused with kUnsupported.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "transport/transport.h"

namespace rubato::transport {

class UcxTransport final : public Transport {
 public:
  // A context and worker for `rank` of `world_size` (in [1, 65536]). kUnavailable when UCX
  // cannot start (no usable transport in UCX_TLS, e.g. a misspelt name), naming UCX's error.
  static Result<std::unique_ptr<UcxTransport>> Create(int rank, int world_size);

  // Cancels outstanding transfers, flushes and closes endpoints (at most ~1 s in all, then
  // forced: a dead peer cannot hang it), destroys the worker and the context.
  ~UcxTransport() override;

  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // This rank's address for its peers' Connect: a small rubato header (magic, rank, world
  // size, length and checksum of the UCX bytes) followed by the UCP worker address.
  std::span<const std::byte> LocalAddress() const { return local_address_; }

  // Creates the endpoint to `peer` from the bytes its LocalAddress returned. kInvalidArgument
  // when peer is out of range or self, or the bytes are not an address of rank `peer` of a
  // world of the same size (wrong length, magic, rank, size or checksum); kFailedPrecondition
  // when `peer` is already connected; kUnavailable when UCX refuses the address.
  Status Connect(int peer, std::span<const std::byte> address);

  std::string_view BackendName() const override { return "ucx"; }
  int Rank() const override { return rank_; }
  int WorldSize() const override { return world_size_; }
  bool SupportsMemory(MemoryKind memory) const override;

  // Also refused: a send to a peer not yet connected (kFailedPrecondition) or lost
  // (kUnavailable), and a device send with a ready_event (kUnsupported).
  Result<TransferId> Post(std::span<const TransferOp> ops) override;
  Result<bool> Test(TransferId id) override;
  Status Wait(TransferId id, std::chrono::milliseconds timeout) override;
  // ucp_request_cancel on each op, then waits (at most 0.5 s) for UCX to hand the requests
  // back; one UCX still holds after that (a rendezvous with a peer lost over shared memory) is
  // logged as a warning and released by UCX when it completes.
  void Cancel(TransferId id) override;
  TransportStats Stats() const override;

  struct State;  // UCX handles, peers and posted groups (ucx_transport.cc)

 private:
  UcxTransport(int rank, int world_size, std::unique_ptr<State> state,
               std::vector<std::byte> local_address);

  const int rank_;
  const int world_size_;
  std::unique_ptr<State> state_;
  std::vector<std::byte> local_address_;  // header + UCP worker address, see LocalAddress
};

}  // namespace rubato::transport
