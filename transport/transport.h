// The data-plane transport between inference ranks and cache ranks: tagged, non-blocking
// point-to-point transfers of host or device buffers, one file per backend (loopback, UCX, NCCL,
// cuda_peer); the device backends add stream-ordered posting (StreamOrderedTransport).
// Every backend matches by (source peer, 48-bit tag) in order, requires exact sizes (kDataLoss
// otherwise), blocks only in Wait (bounded by its timeout), and leaves buffers to the caller until
// a transfer completes or fails. Thread-compatible: one thread drives a Transport.
// Narrative and usage: docs/transport.md "The interface".
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"

namespace rubato::transport {

enum class MemoryKind { kHost, kCuda };

// "host" / "cuda": used in errors and in the metrics label of the memory.
std::string_view MemoryKindName(MemoryKind memory);

inline constexpr uint64_t kMaxTag = (uint64_t{1} << 48) - 1;

// One send or receive of a group that Post starts together (NCCL: one ncclGroupStart/End).
struct TransferOp {
  enum class Direction { kSend, kRecv };

  Direction direction = Direction::kSend;
  int peer = 0;         // rank of the other side, [0, WorldSize()), != Rank()
  uint64_t tag = 0;     // <= kMaxTag
  void* data = nullptr;  // `bytes` bytes of `memory`; may be null only when bytes == 0
  size_t bytes = 0;
  MemoryKind memory = MemoryKind::kHost;
  void* ready_event = nullptr;  // sends of device memory: cudaEvent_t to wait for, or null

  static TransferOp Send(int peer, uint64_t tag, const void* data, size_t bytes,
                         MemoryKind memory = MemoryKind::kHost, void* ready_event = nullptr) {
    return {Direction::kSend, peer, tag, const_cast<void*>(data), bytes, memory, ready_event};
  }
  static TransferOp Recv(int peer, uint64_t tag, void* data, size_t bytes,
                         MemoryKind memory = MemoryKind::kHost) {
    return {Direction::kRecv, peer, tag, data, bytes, memory, nullptr};
  }
};

// Names one Post's group of transfers until Wait / Test reports it done, or Cancel.
using TransferId = uint64_t;

// Totals since the transport was created (the `rubato:transport_bytes_total` counters).
struct TransportStats {
  uint64_t bytes_sent = 0;      // of completed sends (NCCL Enqueue: counted when enqueued)
  uint64_t bytes_received = 0;  // of completed receives (same)
  uint64_t transfers_failed = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // "loopback", "ucx" or "nccl": the `backend` label of the transport metrics.
  virtual std::string_view BackendName() const = 0;
  virtual int Rank() const = 0;
  virtual int WorldSize() const = 0;
  virtual bool SupportsMemory(MemoryKind memory) const = 0;

  // Starts every op of `ops` (at least one) as one group and returns its id. Invalid ops (peer
  // out of range or self, tag > kMaxTag, null data with bytes > 0, unsupported memory) are
  // refused before anything starts, with an error naming the op's index and the problem.
  virtual Result<TransferId> Post(std::span<const TransferOp> ops) = 0;

  // Makes progress; true once every op of the group completed. An error when one failed (the
  // group is then finished and its id released). An unknown id is kInvalidArgument.
  virtual Result<bool> Test(TransferId id) = 0;

  // Blocks until the group completes (ok, id released), fails (its error, id released), or
  // `timeout` passes (kDeadlineExceeded; the group stays posted: Wait again or Cancel it).
  virtual Status Wait(TransferId id, std::chrono::milliseconds timeout) = 0;

  // Gives up on a group: its ops are cancelled where the backend can, and its buffers may be
  // reused once this returns. Backends that cannot take back a posted transfer (NCCL) fail the
  // whole transport instead: every later call returns kUnavailable. Unknown ids are ignored.
  virtual void Cancel(TransferId id) = 0;

  virtual TransportStats Stats() const = 0;
};

// The device backends (nccl, cuda_peer): a group posted behind the work of a caller's CUDA
// stream and awaited by a stream, with no host synchronisation between producer, transfer and
// consumer. Streams are cudaStream_t of this rank's device, passed as void* so that this header
// needs no CUDA. Narrative: docs/transport.md "Stream-ordered transfers".
class StreamOrderedTransport : public Transport {
 public:
  // Post, except that the group starts behind the work already enqueued on `stream` (a send
  // reads its buffer after it, a receive writes its buffer after it) instead of behind the
  // transport's own stream; `stream` then waits for each op's ready_event too. Test, Wait,
  // Cancel and StreamWait take the id as for Post.
  virtual Result<TransferId> PostOnStream(std::span<const TransferOp> ops, void* stream) = 0;

  // Makes `stream` wait, on the GPU, until group `id` has completed: work enqueued on `stream`
  // afterwards sees the received bytes and may overwrite the sent buffers. The host does not
  // wait. The id stays posted (Test / Wait release it). kInvalidArgument for an unknown id;
  // kFailedPrecondition when the backend cannot order on the group yet (cuda_peer: an op whose
  // peer has not posted its side, the error names it).
  virtual Status StreamWait(TransferId id, void* stream) = 0;

  // Whether Enqueue works (nccl): a group ordered by `stream` alone, with no id, no event and no
  // host wait, that a CUDA graph may capture. cuda_peer orders by events of other threads'
  // posts and cannot (PostOnStream + StreamWait instead).
  virtual bool SupportsEnqueue() const { return false; }
  // Enqueues `ops` on `stream` behind its work; later work on `stream` sees the received bytes
  // and may overwrite the sent buffers. kUnsupported where SupportsEnqueue() is false.
  virtual Status Enqueue(std::span<const TransferOp> /*ops*/, void* /*stream*/) {
    return UnsupportedError(std::string(BackendName()) +
                            ": no stream-ordered Enqueue (post with PostOnStream and StreamWait)");
  }
};

}  // namespace rubato::transport
