// The in-process device transport's matching half: a PeerHub connects N ranks of one process
// (threads), matches each send with its peer's receive by (source, tag) in posting order, and
// asks a PeerCopier to move the bytes once both sides are posted. The copier is the device half:
// CUDA streams and events for cuda_peer (cuda_peer_transport.h), a host fake in the CPU tests,
// so that everything here runs in CI without a GPU. Endpoints are StreamOrderedTransports; one
// thread per endpoint, endpoints on any threads (the hub's mutex).
// Narrative and usage: docs/transport.md "cuda_peer".
#pragma once

#include <memory>
#include <string_view>

#include "common/status.h"
#include "transport/transport.h"

namespace rubato::transport {

// What the hub asks of the device. A Mark is an opaque point of device work (cuda_peer: a
// cudaEvent_t), owned by the copier until Recycle. Called with the hub's mutex held, from any
// endpoint's thread; calls never block except Synchronize.
class PeerCopier {
 public:
  using Mark = void*;
  virtual ~PeerCopier() = default;

  virtual std::string_view BackendName() const = 0;
  virtual bool SupportsMemory(MemoryKind memory) const = 0;

  // The point at which `op` of `rank` was posted: on `stream` (null: the rank's own stream),
  // behind the op's ready_event. A send's buffer is read, a receive's written, after it.
  virtual Result<Mark> MarkPosted(int rank, const TransferOp& op, void* stream) = 0;
  // Copies send.bytes (== recv.bytes) from rank `from`'s send buffer into rank `to`'s receive
  // buffer once both posted marks passed; returns the mark of the copy's end.
  virtual Result<Mark> Copy(int from, const TransferOp& send, Mark send_posted, int to,
                            const TransferOp& recv, Mark recv_posted) = 0;
  // true once the work before `mark` is done; an error when it failed.
  virtual Result<bool> Passed(Mark mark) = 0;
  // Makes `stream` (of rank `rank`'s device; null: the rank's own stream) wait for `mark`.
  virtual Status StreamWait(int rank, Mark mark, void* stream) = 0;
  // Blocks until `mark` passed (a copy needs no peer once issued, so this ends).
  virtual void Synchronize(Mark mark) = 0;
  // Gives `mark` back for reuse (work already ordered on it is not affected).
  virtual void Recycle(Mark mark) = 0;
};

struct PeerHubState;  // the queues and groups of all ranks (peer_transport.cc)

class PeerHub {
 public:
  // world_size in [1, 65536]; `copier` serves every rank.
  static Result<std::unique_ptr<PeerHub>> Create(int world_size,
                                                 std::unique_ptr<PeerCopier> copier);

  // The transport of `rank`, in [0, world_size). One endpoint per rank may be alive at a time:
  // a second one for the same rank is kFailedPrecondition until the first is destroyed.
  // Destroying an endpoint cancels its groups (waiting for copies already issued) and fails
  // (kUnavailable) the ops other ranks still have waiting for it.
  Result<std::unique_ptr<StreamOrderedTransport>> Endpoint(int rank);

  int WorldSize() const;

 private:
  explicit PeerHub(std::shared_ptr<PeerHubState> state);
  std::shared_ptr<PeerHubState> state_;
};

}  // namespace rubato::transport
