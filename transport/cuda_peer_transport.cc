// cuda_peer's copier (cuda_peer_transport.h): per rank a stream for Posts without one and a copy
// stream for the bytes it receives; events by device from a pool, so a post costs no
// cudaEventCreate once warm.
#include "transport/cuda_peer_transport.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/peer_access.h"

namespace rubato::transport {
namespace {

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// A mark: an event of one device (recorded only on streams of that device).
struct PooledEvent {
  cudaEvent_t event = nullptr;
  int device = 0;
};

class CudaPeerCopier final : public PeerCopier {
 public:
  ~CudaPeerCopier() override {
    for (PooledEvent* mark : all_) {
      (void)cudaSetDevice(mark->device);
      (void)cudaEventDestroy(mark->event);
      delete mark;
    }
    for (size_t r = 0; r < devices_.size(); ++r) {
      (void)cudaSetDevice(devices_[r]);
      if (own_[r] != nullptr) (void)cudaStreamDestroy(own_[r]);
      if (copy_[r] != nullptr) (void)cudaStreamDestroy(copy_[r]);
    }
  }

  Status Init(std::span<const int> devices) {
    int count = 0;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "cuda_peer: counting devices");
    devices_.assign(devices.begin(), devices.end());
    own_.assign(devices.size(), nullptr);
    copy_.assign(devices.size(), nullptr);
    for (size_t r = 0; r < devices_.size(); ++r) {
      if (devices_[r] < 0 || devices_[r] >= count) {
        return InvalidArgumentError(
            fmt::format("cuda_peer: rank {} on device {}, but this "
                        "process sees {} CUDA device(s)",
                        r, devices_[r], count));
      }
      RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[r]), "cuda_peer: selecting a device");
      RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&own_[r], cudaStreamNonBlocking),
                                  "cuda_peer: creating a rank's stream");
      RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_[r], cudaStreamNonBlocking),
                                  "cuda_peer: creating a rank's copy stream");
      pools_.resize(std::max<size_t>(pools_.size(), static_cast<size_t>(devices_[r]) + 1));
    }
    for (const int a : devices_) {
      for (const int b : devices_) {
        if (a == b) continue;
        const Result<bool> enabled = cuda::EnablePeerAccessOnce(a, b);
        if (!enabled.ok()) return enabled.status().WithContext("cuda_peer");
      }
    }
    return Status::Ok();
  }

  std::string_view BackendName() const override { return "cuda_peer"; }
  bool SupportsMemory(MemoryKind memory) const override { return memory == MemoryKind::kCuda; }

  Result<Mark> MarkPosted(int rank, const TransferOp& op, void* stream) override {
    const int device = devices_[static_cast<size_t>(rank)];
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cuda_peer: selecting the rank's device");
    const cudaStream_t on = stream != nullptr ? AsStream(stream) : own_[static_cast<size_t>(rank)];
    if (op.direction == TransferOp::Direction::kSend && op.ready_event != nullptr) {
      RUBATO_CUDA_RETURN_IF_ERROR(
          cudaStreamWaitEvent(on, static_cast<cudaEvent_t>(op.ready_event), 0),
          "cuda_peer: ordering a send after its ready event");
    }
    return Record(device, on);
  }

  Result<Mark> Copy(int from, const TransferOp& send, Mark send_posted, int to,
                    const TransferOp& recv, Mark recv_posted) override {
    const int source = devices_[static_cast<size_t>(from)];
    const int destination = devices_[static_cast<size_t>(to)];
    const cudaStream_t stream = copy_[static_cast<size_t>(to)];
    // The posting thread may be the sender's: its device is current again when this returns.
    int current = 0;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current), "cuda_peer: reading the device");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(destination), "cuda_peer: selecting a device");
    Result<Mark> done = CopyOn(stream, send, send_posted, source, recv, recv_posted, destination);
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(current), "cuda_peer: restoring the device");
    if (!done.ok()) {
      return Status(done.status().code(),
                    fmt::format("{} (rank {} to rank {})", done.status().message(), from, to));
    }
    return done;
  }

  Result<bool> Passed(Mark mark) override {
    const cudaError_t query = cudaEventQuery(AsMark(mark)->event);
    if (query == cudaSuccess) return true;
    if (query == cudaErrorNotReady) return false;
    return cuda::CudaStatus(query, "cuda_peer: a copy failed");
  }

  Status StreamWait(int rank, Mark mark, void* stream) override {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[static_cast<size_t>(rank)]),
                                "cuda_peer: selecting the rank's device");
    const cudaStream_t on = stream != nullptr ? AsStream(stream) : own_[static_cast<size_t>(rank)];
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(on, AsMark(mark)->event, 0),
                                "cuda_peer: making a stream wait for a transfer");
    return Status::Ok();
  }

  void Synchronize(Mark mark) override { (void)cudaEventSynchronize(AsMark(mark)->event); }

  void Recycle(Mark mark) override {
    PooledEvent* pooled = AsMark(mark);
    pools_[static_cast<size_t>(pooled->device)].push_back(pooled);
  }

 private:
  // Copy's work on the receiver's copy stream, `destination` current.
  Result<Mark> CopyOn(cudaStream_t stream, const TransferOp& send, Mark send_posted, int source,
                      const TransferOp& recv, Mark recv_posted, int destination) {
    for (const Mark mark : {send_posted, recv_posted}) {
      RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, AsMark(mark)->event, 0),
                                  "cuda_peer: ordering a copy after its posts");
    }
    const cudaError_t copied =
        source == destination
            ? cudaMemcpyAsync(recv.data, send.data, send.bytes, cudaMemcpyDeviceToDevice, stream)
            : cudaMemcpyPeerAsync(recv.data, destination, send.data, source, send.bytes, stream);
    RUBATO_CUDA_RETURN_IF_ERROR(
        copied, fmt::format("cuda_peer: copying {} bytes from device {} to device {}, tag {}",
                            send.bytes, source, destination, send.tag));
    return Record(destination, stream);
  }

  static PooledEvent* AsMark(Mark mark) { return static_cast<PooledEvent*>(mark); }

  // An event of `device` (current) from the pool, recorded on `stream`.
  Result<Mark> Record(int device, cudaStream_t stream) {
    std::vector<PooledEvent*>& pool = pools_[static_cast<size_t>(device)];
    if (pool.empty()) {
      auto* created = new PooledEvent{nullptr, device};
      all_.push_back(created);
      RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&created->event, cudaEventDisableTiming),
                                  "cuda_peer: creating an event");
      pool.push_back(created);
    }
    PooledEvent* mark = pool.back();
    const cudaError_t recorded = cudaEventRecord(mark->event, stream);
    if (recorded != cudaSuccess) {
      return cuda::CudaStatus(recorded,
                              "cuda_peer: recording an event (is the stream on the "
                              "rank's device?)");
    }
    pool.pop_back();
    return static_cast<Mark>(mark);
  }

  std::vector<int> devices_;                      // [rank]: its CUDA device
  std::vector<cudaStream_t> own_;                 // [rank]: streams of Posts without one
  std::vector<cudaStream_t> copy_;                // [rank]: copies into the rank's buffers
  std::vector<std::vector<PooledEvent*>> pools_;  // [device]: idle events
  std::vector<PooledEvent*> all_;                 // every event, destroyed with the copier
};

}  // namespace

Result<std::unique_ptr<PeerHub>> CreateCudaPeerHub(std::span<const int> devices) {
  if (devices.empty()) return InvalidArgumentError("cuda_peer: no devices given (one per rank)");
  auto copier = std::make_unique<CudaPeerCopier>();
  RUBATO_RETURN_IF_ERROR(copier->Init(devices));
  return PeerHub::Create(static_cast<int>(devices.size()), std::move(copier));
}

}  // namespace rubato::transport
