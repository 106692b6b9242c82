// NcclHostStagingTransport (nccl_host_staging.h): host buffers staged through device memory on
// the NCCL stream.
#include "transport/nccl_host_staging.h"

#include <cuda_runtime_api.h>

#include <bit>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "kernels/cuda/cuda_status.h"
#include "transport/transfer_validation.h"

namespace rubato::transport {
namespace {

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }
cudaEvent_t AsEvent(void* event) { return static_cast<cudaEvent_t>(event); }

// Staging buffers come in powers of two from 4 KB, so packs whose size changes a little from
// step to step reuse the same buffers.
constexpr size_t kMinStagingBytes = 4096;

}  // namespace

Result<std::unique_ptr<NcclHostStagingTransport>> NcclHostStagingTransport::Create(
    std::unique_ptr<NcclTransport> nccl) {
  if (nccl == nullptr) return InvalidArgumentError("nccl host staging: no NCCL transport");
  return std::unique_ptr<NcclHostStagingTransport>(new NcclHostStagingTransport(std::move(nccl)));
}

NcclHostStagingTransport::~NcclHostStagingTransport() {
  (void)cudaSetDevice(nccl_->Device());
  for (auto& [id, group] : groups_) {
    if (group.copied != nullptr) (void)cudaEventDestroy(AsEvent(group.copied));
    for (Staging& staging : group.sends) retired_.push_back(staging);
    for (HostReceive& receive : group.receives) retired_.push_back(receive.staging);
  }
  // The communicator goes first (aborted: nothing of NCCL's touches the buffers after it), then
  // the stream's copies are waited for by cudaFree's implicit synchronisation.
  nccl_.reset();
  for (auto& [capacity, staging] : free_) retired_.push_back(staging);
  for (Staging& staging : retired_) {
    (void)cudaFree(staging.device);
    (void)cudaFreeHost(staging.pinned);
  }
}

Result<NcclHostStagingTransport::Staging> NcclHostStagingTransport::TakeStaging(size_t bytes) {
  const size_t capacity = std::bit_ceil(std::max(bytes, kMinStagingBytes));
  const auto found = free_.find(capacity);
  if (found != free_.end()) {
    const Staging staging = found->second;
    free_.erase(found);
    return staging;
  }
  Staging staging;
  staging.capacity = capacity;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMalloc(&staging.device, capacity),
                              "nccl host staging: " + std::to_string(capacity) +
                                  " bytes of device staging memory");
  const cudaError_t pinned = cudaHostAlloc(&staging.pinned, capacity, cudaHostAllocDefault);
  if (pinned != cudaSuccess) {
    (void)cudaFree(staging.device);
    return cuda::CudaStatus(pinned, "nccl host staging: " + std::to_string(capacity) +
                                        " bytes of pinned staging memory");
  }
  staging_bytes_ += 2 * capacity;
  return staging;
}

void NcclHostStagingTransport::GiveBack(Staging staging) {
  free_.emplace(staging.capacity, staging);
}

void NcclHostStagingTransport::Release(std::map<TransferId, Group>::iterator group,
                                       bool reusable) {
  Group& g = group->second;
  if (g.copied != nullptr) (void)cudaEventDestroy(AsEvent(g.copied));
  for (Staging& staging : g.sends) reusable ? GiveBack(staging) : retired_.push_back(staging);
  for (HostReceive& receive : g.receives) {
    reusable ? GiveBack(receive.staging) : retired_.push_back(receive.staging);
  }
  groups_.erase(group);
}

Result<TransferId> NcclHostStagingTransport::Post(std::span<const TransferOp> ops) {
  RUBATO_RETURN_IF_ERROR(ValidateOps(*this, ops));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(nccl_->Device()),
                              "nccl host staging: selecting the device");
  const cudaStream_t stream = AsStream(nccl_->Stream());
  Group group;
  std::vector<TransferOp> device_ops(ops.begin(), ops.end());
  // Until the group is handed over, a failure gives its buffers straight back.
  const auto give_back_all = [&] {
    for (Staging& staging : group.sends) GiveBack(staging);
    for (HostReceive& receive : group.receives) GiveBack(receive.staging);
  };
  for (TransferOp& op : device_ops) {
    if (op.memory != MemoryKind::kHost) continue;
    if (op.bytes == 0) {  // nothing to stage (NCCL takes a null buffer of 0 bytes)
      op.memory = MemoryKind::kCuda;
      continue;
    }
    const Result<Staging> staging = TakeStaging(op.bytes);
    if (!staging.ok()) {
      give_back_all();
      return staging.status();
    }
    if (op.direction == TransferOp::Direction::kSend) {
      // The pinned copy is made now, so the caller's buffer is free again when Post returns,
      // and the stream's copy to the device cannot see later writes to it.
      std::memcpy(staging->pinned, op.data, op.bytes);
      group.sends.push_back(*staging);
      const cudaError_t copied = cudaMemcpyAsync(staging->device, staging->pinned, op.bytes,
                                                 cudaMemcpyHostToDevice, stream);
      if (copied != cudaSuccess) {
        give_back_all();
        return cuda::CudaStatus(copied, "nccl host staging: staging a send");
      }
    } else {
      group.receives.push_back({*staging, op.data, op.bytes});
    }
    op.data = staging->device;
    op.memory = MemoryKind::kCuda;
  }
  const Result<TransferId> posted = nccl_->Post(device_ops);
  if (!posted.ok()) {
    give_back_all();
    return posted.status();
  }
  group.nccl_id = *posted;
  const TransferId id = next_id_++;
  auto [it, inserted] = groups_.emplace(id, std::move(group));
  Group& g = it->second;
  // The receives' copies back to pinned memory, after the NCCL group on the same stream.
  Status staged = Status::Ok();
  for (const HostReceive& receive : g.receives) {
    staged = cuda::CudaStatus(cudaMemcpyAsync(receive.staging.pinned, receive.staging.device,
                                              receive.bytes, cudaMemcpyDeviceToHost, stream),
                              "nccl host staging: staging a receive");
    if (!staged.ok()) break;
  }
  cudaEvent_t copied = nullptr;
  if (staged.ok()) {
    staged = cuda::CudaStatus(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming),
                              "nccl host staging: creating an event");
  }
  if (staged.ok()) {
    g.copied = copied;
    staged = cuda::CudaStatus(cudaEventRecord(copied, stream),
                              "nccl host staging: recording an event");
  }
  if (!staged.ok()) {
    // The NCCL group is in flight with our buffers: give it up (aborts the communicator).
    nccl_->Cancel(g.nccl_id);
    Release(it, /*reusable=*/false);
    return staged;
  }
  return id;
}

Result<bool> NcclHostStagingTransport::Test(TransferId id) {
  const auto group = groups_.find(id);
  if (group == groups_.end()) {
    return InvalidArgumentError("nccl host staging: unknown transfer id " + std::to_string(id));
  }
  Group& g = group->second;
  if (!g.nccl_done) {
    const Result<bool> done = nccl_->Test(g.nccl_id);
    if (!done.ok()) {
      Release(group, /*reusable=*/false);
      return done.status();
    }
    if (!*done) return false;
    g.nccl_done = true;
  }
  const cudaError_t query = cudaEventQuery(AsEvent(g.copied));
  if (query == cudaErrorNotReady) return false;
  if (query != cudaSuccess) {
    const Status error = cuda::CudaStatus(query, "nccl host staging: transfer " +
                                                     std::to_string(id));
    Release(group, /*reusable=*/false);
    return error;
  }
  for (const HostReceive& receive : g.receives) {
    std::memcpy(receive.into, receive.staging.pinned, receive.bytes);
  }
  Release(group, /*reusable=*/true);
  return true;
}

Status NcclHostStagingTransport::Wait(TransferId id, std::chrono::milliseconds timeout) {
  return WaitByTesting(*this, id, timeout);
}

void NcclHostStagingTransport::Cancel(TransferId id) {
  const auto group = groups_.find(id);
  if (group == groups_.end()) return;
  Group& g = group->second;
  if (!g.nccl_done) {
    nccl_->Cancel(g.nccl_id);  // aborts the communicator when still in flight
    Release(group, /*reusable=*/false);
    return;
  }
  // The NCCL part is done; the copies back may still run: let them finish before the buffers
  // can be reused (cudaEventSynchronize of a recorded event ends).
  (void)cudaEventSynchronize(AsEvent(g.copied));
  Release(group, /*reusable=*/true);
}

Result<std::array<std::unique_ptr<Transport>, 2>> CreateNcclHostStagingPair(
    std::array<int, 2> devices, std::chrono::milliseconds init_timeout) {
  if (devices[0] == devices[1]) {
    return InvalidArgumentError("nccl: both ranks on device " + std::to_string(devices[0]) +
                                " (NCCL needs a GPU per rank)");
  }
  RUBATO_ASSIGN_OR_RETURN(const std::string id, NcclTransport::NewUniqueId());
  std::array<Result<std::unique_ptr<NcclTransport>>, 2> created{
      InternalError("not created"), InternalError("not created")};
  std::atomic<bool> give_up{false};
  std::array<std::thread, 2> threads;
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      created[r] = NcclTransport::Create({.unique_id = id, .rank = r, .world_size = 2,
                                          .device = devices[r], .init_timeout = init_timeout,
                                          .give_up = &give_up});
      if (!created[r].ok()) give_up = true;  // the other rank stops waiting for this one
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::array<std::unique_ptr<Transport>, 2> pair;
  for (int r = 0; r < 2; ++r) {
    if (!created[r].ok()) {
      return created[r].status().WithContext("nccl: rank " + std::to_string(r) + " on device " +
                                             std::to_string(devices[r]));
    }
  }
  for (int r = 0; r < 2; ++r) {
    RUBATO_ASSIGN_OR_RETURN(pair[r],
                            NcclHostStagingTransport::Create(std::move(created[r]).value()));
  }
  return pair;
}

}  // namespace rubato::transport
