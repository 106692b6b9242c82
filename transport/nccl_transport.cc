// NCCL backend (nccl_transport.h): communicator setup, grouped send / receive on the
// transport's stream, completion by CUDA events, abort on timeout or peer failure.
#include "transport/nccl_transport.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
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
// `give_up` (may be null) reads true.
Status AwaitCommReady(ncclComm_t comm, std::chrono::milliseconds timeout, std::string_view what,
                      const std::atomic<bool>* give_up = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    ncclResult_t state = ncclSuccess;
    RUBATO_RETURN_IF_ERROR(NcclStatus(ncclCommGetAsyncError(comm, &state), what));
    if (state != ncclInProgress) return NcclStatus(state, what);
    if (give_up != nullptr && give_up->load()) {
      return UnavailableError("nccl: " + std::string(what) + " given up (the other rank is not "
                            "coming)");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceededError("nccl: " + std::string(what) + " did not finish within " +
                                   std::to_string(timeout.count()) +
                                   " ms (is every rank of the communicator running?)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
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
  return transport;
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
    (void)ncclCommAbort(AsComm(comm_));
    comm_ = nullptr;
    (void)cudaStreamSynchronize(AsStream(stream_));
  }
  (void)cudaFree(bytes);
  return status;
}

NcclTransport::~NcclTransport() {
  if (device_ >= 0) (void)cudaSetDevice(device_);
  for (auto& [id, group] : groups_) {
    if (group.done != nullptr) (void)cudaEventDestroy(AsEvent(group.done));
  }
  if (comm_ != nullptr) {
    // Abort, not finalize: finalize waits for outstanding operations, which may never end
    // when the peer is gone.
    (void)ncclCommAbort(AsComm(comm_));
  }
  if (stream_ != nullptr) (void)cudaStreamDestroy(AsStream(stream_));
}

Status NcclTransport::Health() {
  if (!failed_.ok()) return failed_;
  ncclResult_t state = ncclSuccess;
  const Status query = NcclStatus(ncclCommGetAsyncError(AsComm(comm_), &state), "health");
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
  if (comm_ != nullptr) {
    (void)ncclCommAbort(AsComm(comm_));
    comm_ = nullptr;
  }
}

Result<TransferId> NcclTransport::Post(std::span<const TransferOp> ops) {
  RUBATO_RETURN_IF_ERROR(Health());
  RUBATO_RETURN_IF_ERROR(ValidateOps(*this, ops));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "nccl: selecting the device");
  Group group;
  for (const TransferOp& op : ops) {
    if (op.direction == TransferOp::Direction::kSend && op.ready_event != nullptr) {
      RUBATO_CUDA_RETURN_IF_ERROR(
          cudaStreamWaitEvent(AsStream(stream_), AsEvent(op.ready_event), 0),
          "nccl: ordering a send after its ready event");
    }
  }
  RUBATO_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
  Status enqueue = Status::Ok();
  for (const TransferOp& op : ops) {
    if (op.direction == TransferOp::Direction::kSend) {
      enqueue = NcclStatus(ncclSend(op.data, op.bytes, ncclUint8, op.peer, AsComm(comm_),
                                    AsStream(stream_)),
                           "ncclSend");
      group.bytes_sent += op.bytes;
    } else {
      enqueue = NcclStatus(ncclRecv(op.data, op.bytes, ncclUint8, op.peer, AsComm(comm_),
                                    AsStream(stream_)),
                           "ncclRecv");
      group.bytes_received += op.bytes;
    }
    if (!enqueue.ok()) break;
  }
  const Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  if (!enqueue.ok() || !end.ok()) {
    Fail(!enqueue.ok() ? enqueue : end);
    return failed_;
  }
  const Status taken = AwaitCommReady(AsComm(comm_), kEnqueueTimeout, "enqueuing a group");
  if (!taken.ok()) {
    Fail(taken);
    return failed_;
  }
  cudaEvent_t done = nullptr;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming),
                              "nccl: creating a completion event");
  group.done = done;
  const Status recorded =
      cuda::CudaStatus(cudaEventRecord(done, AsStream(stream_)), "nccl: recording completion");
  if (!recorded.ok()) {
    (void)cudaEventDestroy(done);
    return recorded;
  }
  const TransferId id = next_id_++;
  groups_.emplace(id, group);
  return id;
}

void NcclTransport::Release(std::map<TransferId, Group>::iterator group, bool completed) {
  if (completed) {
    stats_.bytes_sent += group->second.bytes_sent;
    stats_.bytes_received += group->second.bytes_received;
  }
  (void)cudaEventDestroy(AsEvent(group->second.done));
  groups_.erase(group);
}

Result<bool> NcclTransport::Test(TransferId id) {
  const auto group = groups_.find(id);
  if (group == groups_.end()) {
    return InvalidArgumentError("nccl: unknown transfer id " + std::to_string(id));
  }
  const cudaError_t query = cudaEventQuery(AsEvent(group->second.done));
  if (query == cudaSuccess) {
    Release(group, /*completed=*/true);
    return true;
  }
  if (query != cudaErrorNotReady) {
    const Status error = cuda::CudaStatus(query, "nccl: transfer " + std::to_string(id));
    Release(group, /*completed=*/false);
    Fail(error);
    return error;
  }
  const Status health = Health();
  if (!health.ok()) {
    Release(group, /*completed=*/false);
    return health;
  }
  return false;
}

Status NcclTransport::Wait(TransferId id, std::chrono::milliseconds timeout) {
  return WaitByTesting(*this, id, timeout);
}

void NcclTransport::Cancel(TransferId id) {
  const auto group = groups_.find(id);
  if (group == groups_.end()) return;
  if (cudaEventQuery(AsEvent(group->second.done)) == cudaSuccess) {
    Release(group, /*completed=*/true);
    return;
  }
  // A posted NCCL operation cannot be withdrawn: the only way to free its buffers is to abort
  // the communicator (nccl_transport.h).
  Release(group, /*completed=*/false);
  Fail(UnavailableError("transfer " + std::to_string(id) + " was cancelled in flight"));
}

void* NcclTransport::DoneEvent(TransferId id) const {
  const auto group = groups_.find(id);
  return group == groups_.end() ? nullptr : group->second.done;
}

}  // namespace rubato::transport
