// NCCL backend (nccl_transport.h): communicator setup, send / receive (grouped when several) on
// the transport's or the caller's stream, completion by pooled CUDA events, abort on timeout or
// peer failure.
#include "transport/nccl_transport.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/logging.h"
#include "kernels/cuda/cuda_status.h"
#include "transport/transfer_validation.h"

namespace rubato::transport {
namespace {

ncclComm_t AsComm(void* comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }
cudaEvent_t AsEvent(void* event) { return static_cast<cudaEvent_t>(event); }

Status NcclStatus(ncclResult_t result, std::string_view what) {
  if (result == ncclSuccess || result == ncclInProgress) return Status::Ok();
  const std::string message =
      "nccl: " + std::string(what) + ": " + ncclGetErrorString(result) +
      (result == ncclSystemError || result == ncclRemoteError
           ? std::string(" (a peer may have exited or the network failed)")
           : std::string());
  if (result == ncclInvalidArgument || result == ncclInvalidUsage) {
    return InvalidArgumentError(message);
  }
  return UnavailableError(message);
}

// Polls the non-blocking communicator until it leaves ncclInProgress, `timeout` passes or
// `give_up` (may be null) reads true. Yields between polls for the first millisecond (taking a
// group is quick once the peers are connected), then sleeps.
Status AwaitCommReady(ncclComm_t comm, std::chrono::milliseconds timeout, std::string_view what,
                      const std::atomic<bool>* give_up = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  const auto spin_until = start + std::chrono::milliseconds(1);
  while (true) {
    ncclResult_t state = ncclSuccess;
    RUBATO_RETURN_IF_ERROR(NcclStatus(ncclCommGetAsyncError(comm, &state), what));
    if (state != ncclInProgress) return NcclStatus(state, what);
    if (give_up != nullptr && give_up->load()) {
      return UnavailableError("nccl: " + std::string(what) + " given up (the other rank is not "
                            "coming)");
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return DeadlineExceededError("nccl: " + std::string(what) + " did not finish within " +
                                   std::to_string(timeout.count()) +
                                   " ms (is every rank of the communicator running?)");
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

// How long Post waits for NCCL to take a group (its first use of a peer sets up the
// connection, which needs the peer to post its side).
constexpr std::chrono::milliseconds kEnqueueTimeout{60000};

}  // namespace

Result<std::string> NcclTransport::NewUniqueId() {
  ncclUniqueId id;
  RUBATO_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  return std::string(id.internal, sizeof(id.internal));
}

Result<std::unique_ptr<NcclTransport>> NcclTransport::Create(const NcclTransportOptions& options) {
  if (options.world_size < 2) {
    return InvalidArgumentError("nccl: world_size = " + std::to_string(options.world_size) +
                                " must be >= 2");
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return InvalidArgumentError("nccl: rank " + std::to_string(options.rank) +
                                " outside [0, " + std::to_string(options.world_size) + ")");
  }
  ncclUniqueId id;
  if (options.unique_id.size() != sizeof(id.internal)) {
    return InvalidArgumentError("nccl: unique id has " + std::to_string(options.unique_id.size()) +
                                " bytes, expected " + std::to_string(sizeof(id.internal)) +
                                " (NcclTransport::NewUniqueId's output)");
  }
  std::memcpy(id.internal, options.unique_id.data(), sizeof(id.internal));

  std::unique_ptr<NcclTransport> transport(new NcclTransport());
  transport->rank_ = options.rank;
  transport->world_size_ = options.world_size;
  transport->device_ = options.device;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device),
                              "nccl: selecting device " + std::to_string(options.device));
  cudaStream_t stream = nullptr;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                              "nccl: creating the transport stream");
  transport->stream_ = stream;

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a dead peer can be given up on (ncclCommAbort)
  ncclComm_t comm = nullptr;
  RUBATO_RETURN_IF_ERROR(NcclStatus(
      ncclCommInitRankConfig(&comm, options.world_size, id, options.rank, &config),
      "ncclCommInitRankConfig"));
  transport->comm_ = comm;
  const auto started = std::chrono::steady_clock::now();
  RUBATO_RETURN_IF_ERROR(AwaitCommReady(comm, options.init_timeout, "joining the communicator",
                                        options.give_up));  // the destructor aborts on errors
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      options.init_timeout - (std::chrono::steady_clock::now() - started));
  RUBATO_RETURN_IF_ERROR(
      transport->ConnectPeers(std::max(left, std::chrono::milliseconds(1)), options.give_up));
  if (options.blocking_data_comm) {
    const auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(
        options.init_timeout - (std::chrono::steady_clock::now() - started));
    RUBATO_RETURN_IF_ERROR(transport->SplitDataComm(
        std::max(remaining, std::chrono::milliseconds(1)), options.give_up));
  }
  return transport;
}

// A non-blocking communicator launches every group from a thread that NCCL creates for it
// (tens of microseconds per group); a blocking one launches on the caller's thread. The split
// itself runs in the parent's non-blocking mode (it can time out and be given up on); sharing
// the parent's resources, the child reuses the connections ConnectPeers set up, so none of its
// calls waits for a peer on the host.
Status NcclTransport::SplitDataComm(std::chrono::milliseconds timeout,
                                    const std::atomic<bool>* give_up) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  config.splitShare = 1;
  ncclComm_t child = nullptr;
  Status status = NcclStatus(ncclCommSplit(AsComm(comm_), 0, rank_, &child, &config),
                             "ncclCommSplit");
  if (status.ok()) {
    status = AwaitCommReady(AsComm(comm_), timeout, "splitting the data communicator", give_up);
  }
  if (status.ok() && child == nullptr) {
    status = UnavailableError("nccl: ncclCommSplit gave no communicator");
  }
  if (!status.ok()) {
    if (child != nullptr) (void)ncclCommAbort(child);
    (void)ncclCommAbort(AsComm(comm_));
    comm_ = nullptr;
    return status;
  }
  setup_comm_ = comm_;
  comm_ = child;
  return ConnectPeers(timeout, give_up);
}

Status NcclTransport::ConnectPeers(std::chrono::milliseconds timeout,
                                   const std::atomic<bool>* give_up) {
  // One byte out to and in from each peer (bytes [0, world) out, [world, 2 world) in).
  void* bytes = nullptr;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMalloc(&bytes, 2 * static_cast<size_t>(world_size_)),
                              "nccl: connecting the peers");
  auto* out = static_cast<uint8_t*>(bytes);
  uint8_t* in = out + world_size_;
  Status status = NcclStatus(ncclGroupStart(), "ncclGroupStart");
  for (int peer = 0; peer < world_size_ && status.ok(); ++peer) {
    if (peer == rank_) continue;
    status = NcclStatus(ncclSend(out + peer, 1, ncclUint8, peer, AsComm(comm_),
                                 AsStream(stream_)), "ncclSend");
    if (status.ok()) {
      status = NcclStatus(ncclRecv(in + peer, 1, ncclUint8, peer, AsComm(comm_),
                                   AsStream(stream_)), "ncclRecv");
    }
  }
  const Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  if (status.ok()) status = end;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (status.ok()) status = AwaitCommReady(AsComm(comm_), timeout, "connecting the peers", give_up);
  while (status.ok()) {
    const cudaError_t query = cudaStreamQuery(AsStream(stream_));
    if (query == cudaSuccess) break;
    if (query != cudaErrorNotReady) {
      status = cuda::CudaStatus(query, "nccl: connecting the peers");
    } else if (give_up != nullptr && give_up->load()) {
      status = UnavailableError("nccl: connecting the peers given up (the other rank is not "
                              "coming)");
    } else if (std::chrono::steady_clock::now() >= deadline) {
      status = DeadlineExceededError("nccl: connecting the peers did not finish within " +
                                     std::to_string(timeout.count()) + " ms");
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  if (!status.ok()) {
    // The exchange may still be on the stream: abort before its buffer goes.
    AbortComms();
    (void)cudaStreamSynchronize(AsStream(stream_));
  }
  (void)cudaFree(bytes);
  return status;
}

NcclTransport::~NcclTransport() {
  if (device_ >= 0) (void)cudaSetDevice(device_);
  // Abort, not finalize: finalize waits for outstanding operations, which may never end when
  // the peer is gone.
  AbortComms();
  for (const Group& group : groups_) events_.push_back(group.done);
  for (void* event : events_) (void)cudaEventDestroy(AsEvent(event));
  if (stream_ != nullptr) (void)cudaStreamDestroy(AsStream(stream_));
}

Status NcclTransport::Health() {
  if (!failed_.ok()) return failed_;
  ncclResult_t state = ncclSuccess;
  Status query;
  {
    std::lock_guard lock(comm_mutex_);
    if (comm_ == nullptr) {
      query = abort_reason_;  // aborted by another thread
    } else {
      query = NcclStatus(ncclCommGetAsyncError(AsComm(comm_), &state), "health");
    }
  }
  if (!query.ok()) {
    Fail(query);
    return failed_;
  }
  if (state != ncclSuccess && state != ncclInProgress) {
    Fail(NcclStatus(state, "asynchronous error"));
    return failed_;
  }
  return Status::Ok();
}

void NcclTransport::Fail(Status why) {
  if (!failed_.ok()) return;
  RUBATO_LOG_WARN("transport", "nccl rank {}: aborting the communicator: {}", rank_,
                  why.message());
  failed_ = Status(StatusCode::kUnavailable,
                   "nccl transport of rank " + std::to_string(rank_) +
                       " is aborted: " + why.message());
  ++stats_.transfers_failed;
  std::lock_guard lock(comm_mutex_);
  AbortComms();
}

void NcclTransport::AbortComms() {
  // The data communicator first: it shares the setup communicator's resources.
  if (comm_ != nullptr) (void)ncclCommAbort(AsComm(comm_));
  if (setup_comm_ != nullptr) (void)ncclCommAbort(AsComm(setup_comm_));
  comm_ = nullptr;
  setup_comm_ = nullptr;
}

void NcclTransport::AbortFromAnyThread(const Status& why) {
  std::lock_guard lock(comm_mutex_);
  if (comm_ == nullptr) return;
  RUBATO_LOG_WARN("transport", "nccl rank {}: aborting the communicator: {}", rank_,
                  why.message());
  abort_reason_ = UnavailableError("aborted: " + why.message());
  (void)cudaSetDevice(device_);
  AbortComms();
}

Status NcclTransport::EnqueueOps(std::span<const TransferOp> ops, void* stream,
                                 uint64_t& bytes_sent, uint64_t& bytes_received) {
  for (const TransferOp& op : ops) {
    if (op.direction == TransferOp::Direction::kSend && op.ready_event != nullptr) {
      RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(AsStream(stream), AsEvent(op.ready_event), 0),
                                  "nccl: ordering a send after its ready event");
    }
  }
  // A group costs a host round of NCCL's group machinery: only when several ops must start
  // together (a send and a receive of one round would otherwise wait for each other).
  const bool grouped = ops.size() > 1;
  std::unique_lock lock(comm_mutex_);  // AbortFromAnyThread may not free comm_ under the calls
  if (comm_ == nullptr) {
    lock.unlock();
    RUBATO_RETURN_IF_ERROR(Health());
    return UnavailableError("nccl: the communicator is gone");
  }
  Status enqueue = grouped ? NcclStatus(ncclGroupStart(), "ncclGroupStart") : Status::Ok();
  for (size_t i = 0; i < ops.size() && enqueue.ok(); ++i) {
    const TransferOp& op = ops[i];
    if (op.direction == TransferOp::Direction::kSend) {
      enqueue = NcclStatus(ncclSend(op.data, op.bytes, ncclUint8, op.peer, AsComm(comm_),
                                    AsStream(stream)),
                           "ncclSend");
      bytes_sent += op.bytes;
    } else {
      enqueue = NcclStatus(ncclRecv(op.data, op.bytes, ncclUint8, op.peer, AsComm(comm_),
                                    AsStream(stream)),
                           "ncclRecv");
      bytes_received += op.bytes;
    }
  }
  if (grouped) {
    const Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
    if (enqueue.ok()) enqueue = end;
  }
  if (enqueue.ok()) {
    enqueue = AwaitCommReady(AsComm(comm_), kEnqueueTimeout, "enqueuing a group");
  }
  lock.unlock();
  if (!enqueue.ok()) {
    Fail(enqueue);
    return failed_;
  }
  return Status::Ok();
}

Result<void*> NcclTransport::TakeEvent() {
  if (!events_.empty()) {
    void* event = events_.back();
    events_.pop_back();
    return event;
  }
  cudaEvent_t event = nullptr;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                              "nccl: creating a completion event");
  return static_cast<void*>(event);
}

Result<TransferId> NcclTransport::Post(std::span<const TransferOp> ops) {
  return PostOnStream(ops, stream_);
}

Result<TransferId> NcclTransport::PostOnStream(std::span<const TransferOp> ops, void* stream) {
  RUBATO_RETURN_IF_ERROR(Health());
  RUBATO_RETURN_IF_ERROR(ValidateOps(*this, ops));
  if (stream == nullptr) {
    return InvalidArgumentError("nccl: PostOnStream needs a stream (the legacy default stream "
                                "would serialise with every other stream of the device)");
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "nccl: selecting the device");
  // The event first: once the ops are enqueued, a failure to get one would strand them.
  RUBATO_ASSIGN_OR_RETURN(void* done, TakeEvent());
  Group group{.id = next_id_, .done = done};
  const Status enqueued = EnqueueOps(ops, stream, group.bytes_sent, group.bytes_received);
  if (!enqueued.ok()) {
    events_.push_back(done);
    return enqueued;
  }
  const Status recorded = cuda::CudaStatus(cudaEventRecord(AsEvent(done), AsStream(stream)),
                                           "nccl: recording completion");
  if (!recorded.ok()) {
    // The group runs with nothing to tell when it ends: its buffers cannot be handed back.
    events_.push_back(done);
    Fail(recorded);
    return failed_;
  }
  ++next_id_;
  groups_.push_back(group);
  return group.id;
}

Status NcclTransport::Enqueue(std::span<const TransferOp> ops, void* stream) {
  RUBATO_RETURN_IF_ERROR(Health());
  RUBATO_RETURN_IF_ERROR(ValidateOps(*this, ops));
  if (stream == nullptr) {
    return InvalidArgumentError("nccl: Enqueue needs a stream (the legacy default stream "
                                "cannot be captured and serialises with every other stream)");
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "nccl: selecting the device");
  return EnqueueOps(ops, stream, stats_.bytes_sent, stats_.bytes_received);
}

Status NcclTransport::StreamWait(TransferId id, void* stream) {
  const size_t index = FindGroup(id);
  if (index == groups_.size()) {
    return InvalidArgumentError("nccl: StreamWait: unknown transfer id " + std::to_string(id));
  }
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaStreamWaitEvent(AsStream(stream), AsEvent(groups_[index].done), 0),
      "nccl: making a stream wait for transfer " + std::to_string(id));
  return Status::Ok();
}

size_t NcclTransport::FindGroup(TransferId id) const {
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (groups_[i].id == id) return i;
  }
  return groups_.size();
}

void NcclTransport::Release(size_t index, bool completed) {
  Group& group = groups_[index];
  if (completed) {
    stats_.bytes_sent += group.bytes_sent;
    stats_.bytes_received += group.bytes_received;
  }
  // A group that did not complete leaves the transport failed (every caller of this fails it),
  // so its event, which aborted work may still touch, is never recorded again.
  events_.push_back(group.done);
  group = groups_.back();
  groups_.pop_back();
}

Result<bool> NcclTransport::Test(TransferId id) {
  const size_t index = FindGroup(id);
  if (index == groups_.size()) {
    return InvalidArgumentError("nccl: unknown transfer id " + std::to_string(id));
  }
  const cudaError_t query = cudaEventQuery(AsEvent(groups_[index].done));
  if (query == cudaSuccess) {
    Release(index, /*completed=*/true);
    return true;
  }
  if (query != cudaErrorNotReady) {
    const Status error = cuda::CudaStatus(query, "nccl: transfer " + std::to_string(id));
    Release(index, /*completed=*/false);
    Fail(error);
    return error;
  }
  const Status health = Health();
  if (!health.ok()) {
    Release(index, /*completed=*/false);
    return health;
  }
  return false;
}

Status NcclTransport::Wait(TransferId id, std::chrono::milliseconds timeout) {
  return WaitBySpinning(*this, id, timeout);
}

void NcclTransport::Cancel(TransferId id) {
  const size_t index = FindGroup(id);
  if (index == groups_.size()) return;
  if (cudaEventQuery(AsEvent(groups_[index].done)) == cudaSuccess) {
    Release(index, /*completed=*/true);
    return;
  }
  // A posted NCCL operation cannot be withdrawn: the only way to free its buffers is to abort
  // the communicator (nccl_transport.h).
  Release(index, /*completed=*/false);
  Fail(UnavailableError("transfer " + std::to_string(id) + " was cancelled in flight"));
}

void* NcclTransport::DoneEvent(TransferId id) const {
  const size_t index = FindGroup(id);
  return index == groups_.size() ? nullptr : groups_[index].done;
}

}  // namespace rubato::transport
