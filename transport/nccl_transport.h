// NCCL backend of the data-plane Transport: GPU-to-GPU point-to-point transfers, each Post one
// NCCL group of sends / receives on the transport's own CUDA stream (PostOnStream, Enqueue: on
// the caller's), completion tracked by a pooled event. Device memory only; Create is
// collective; Create, the posts and the destructor leave `device` current. NCCL sees neither
// message sizes nor dead peers: the ranks join and connect on a non-blocking communicator, so
// that a timeout can abort it, and post on a blocking one split from it (NCCL launches its groups
// on the caller's thread); an abort ends both, after which every call returns kUnavailable.
// Enqueue is capturable in a CUDA graph.
// Narrative and usage: docs/transport.md "NCCL" and "Stream-ordered transfers".
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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
  // Posts go through a blocking communicator split from the non-blocking one that joined and
  // connected the peers: NCCL launches a blocking communicator's groups on the caller's thread,
  // a non-blocking one's from a new thread per group. false keeps the non-blocking one (the
  // transport benchmark measures both).
  bool blocking_data_comm = true;
};

class NcclTransport final : public StreamOrderedTransport {
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

  Result<TransferId> PostOnStream(std::span<const TransferOp> ops, void* stream) override;
  Status StreamWait(TransferId id, void* stream) override;

  // The purely stream-ordered form, for a step that runs as a CUDA graph: enqueues `ops` on
  // `stream` behind its work (and each send's ready_event) and returns once NCCL took them,
  // without an id or an event; completion is `stream`'s order (work enqueued after sees the
  // received bytes). May be called while `stream` is being captured (cudaStreamCaptureMode
  // ThreadLocal or Relaxed when several threads drive ranks); every rank must then capture its
  // side, and each graph launch is a collective of the ranks that captured. Ops are validated
  // as for Post; bytes count in Stats when enqueued (a captured graph's once, at capture). NCCL
  // cannot take back enqueued work: a failure aborts the transport.
  bool SupportsEnqueue() const override { return true; }
  Status Enqueue(std::span<const TransferOp> ops, void* stream) override;

  // From any thread (a watchdog that learned the peer is gone): aborts the communicator, so that
  // NCCL kernels still waiting for the peer on any stream end, and fails the transport (every
  // later call of its owner returns kUnavailable naming `why`). Device work that waited for the
  // aborted transfers runs on with whatever the buffers hold: the owner must learn of the abort
  // (a later call, or Health through Test) before it trusts them. Idempotent.
  void AbortFromAnyThread(const Status& why);

  // The dedicated stream every Post group runs on.
  void* Stream() const { return stream_; }
  // The cudaEvent_t recorded after the group `id`, or null for an unknown id. Valid until the
  // group is released by Test / Wait / Cancel (the event then goes back to the pool).
  void* DoneEvent(TransferId id) const;

 private:
  struct Group {
    TransferId id = 0;
    void* done = nullptr;  // cudaEvent_t from events_
    uint64_t bytes_sent = 0;
    uint64_t bytes_received = 0;
  };

  NcclTransport() = default;
  // Exchanges a byte with every other rank so that NCCL sets up every peer connection now.
  // NCCL connects a peer lazily, at the first group that names it, and that group cannot finish
  // before the peer joins in; a cache rank's first receive would otherwise wait (and block its
  // thread) until the inference rank's first pack, however late that comes.
  Status ConnectPeers(std::chrono::milliseconds timeout, const std::atomic<bool>* give_up);
  // Splits the blocking data communicator off comm_ (which becomes setup_comm_) and connects it.
  Status SplitDataComm(std::chrono::milliseconds timeout, const std::atomic<bool>* give_up);
  // Aborts the data and the setup communicators (callers hold comm_mutex_ or own the transport).
  void AbortComms();
  // kUnavailable once the communicator is aborted, else the communicator's asynchronous error.
  Status Health();
  // Marks the transport failed with `why` and aborts the communicator (idempotent).
  void Fail(Status why);
  // Enqueues the NCCL calls of `ops` (validated) on `stream`: one group when there are several.
  // Adds their bytes to the two counters. A failure aborts the transport.
  Status EnqueueOps(std::span<const TransferOp> ops, void* stream, uint64_t& bytes_sent,
                    uint64_t& bytes_received);
  Result<void*> TakeEvent();
  size_t FindGroup(TransferId id) const;  // index into groups_, or groups_.size()
  void Release(size_t index, bool completed);

  int rank_ = 0;
  int world_size_ = 0;
  int device_ = 0;
  std::mutex comm_mutex_;       // guards comm_ against AbortFromAnyThread
  void* comm_ = nullptr;        // ncclComm_t of every post; null once aborted
  void* setup_comm_ = nullptr;  // the non-blocking parent of a blocking comm_, or null
  Status abort_reason_;         // under comm_mutex_: why AbortFromAnyThread ran
  void* stream_ = nullptr;      // cudaStream_t
  Status failed_;               // ok until the communicator is aborted
  TransferId next_id_ = 1;
  // Groups in flight, in no order (few: a linear search beats a map's allocation per Post).
  std::vector<Group> groups_;
  std::vector<void*> events_;  // idle cudaEvent_t (timing disabled), reused by later Posts
  TransportStats stats_;
};

}  // namespace rubato::transport
