// The UCX Transport: UCP's tag API between processes, host memory everywhere and CUDA memory
// where the UCX runtime has CUDA support. One UCP context and worker per transport, driven by
// one thread; progress only inside Test, Wait, Cancel and the destructor. UCX_TLS picks the
// wires; error mode PEER (where a wire supports it) fails a lost peer's transfers with
// kUnavailable. ready_event on device sends is refused (kUnsupported).
// Narrative (UCX_TLS choices, lost-peer detection, wire tags): docs/transport.md "UCX".
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
