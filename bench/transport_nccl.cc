// The two-GPU part of rubato_bench_transport; see bench/transport_nccl.h, and
// docs/benchmarks.md "Transport" for what is measured and how.
#include "bench/transport_nccl.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>

#include "kernels/cuda/cuda_status.h"
#include "transport/nccl_transport.h"

namespace rubato::bench {
namespace {

using transport::TransferId;
using transport::TransferOp;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

// ---- two GPUs: NCCL through NcclTransport and cudaMemcpyPeer ----------------------------------

using transport::MemoryKind;
using transport::NcclTransport;

constexpr std::chrono::milliseconds kNcclWait{60000};

struct DeviceBuffer {
  void* data = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (data != nullptr) (void)cudaFree(data);
  }
};

Status Allocate(int device, size_t bytes, DeviceBuffer& buffer) {
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "selecting a device");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMalloc(&buffer.data, bytes == 0 ? 1 : bytes),
                              "allocating " + std::to_string(bytes) + " bytes");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(buffer.data, 1, bytes == 0 ? 1 : bytes), "filling");
  return Status::Ok();
}

struct Timing {
  double bandwidth_gbps = 0;  // bytes / second / 1e9, pipelined
  double latency_us = 0;      // one transfer at a time, host-observed
};

Result<Timing> TimeMemcpyPeer(size_t bytes, const NcclBenchOptions& options) {
  DeviceBuffer source, destination;
  RUBATO_RETURN_IF_ERROR(Allocate(0, bytes, source));
  RUBATO_RETURN_IF_ERROR(Allocate(1, bytes, destination));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(1), "device 1");
  cudaStream_t stream = nullptr;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const auto copy = [&] {
    return cudaMemcpyPeerAsync(destination.data, 1, source.data, 0, bytes, stream);
  };
  Timing timing;
  for (int i = 0; i < 2; ++i) (void)copy();  // warm-up
  (void)cudaStreamSynchronize(stream);
  auto start = Clock::now();
  for (int i = 0; i < options.iterations; ++i) {
    RUBATO_CUDA_RETURN_IF_ERROR(copy(), "cudaMemcpyPeerAsync");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "synchronizing");
  }
  timing.latency_us =
      std::chrono::duration<double, std::micro>(Clock::now() - start).count() / options.iterations;
  start = Clock::now();
  for (int i = 0; i < options.iterations * options.pipeline; ++i) {
    RUBATO_CUDA_RETURN_IF_ERROR(copy(), "cudaMemcpyPeerAsync");
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "synchronizing");
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  timing.bandwidth_gbps =
      static_cast<double>(bytes) * options.iterations * options.pipeline / seconds / 1e9;
  (void)cudaStreamDestroy(stream);
  return timing;
}

// Two ranks, one thread and one GPU each. Rank 0 sends `up` bytes and receives `down` bytes per
// round; rank 1 the other way round (down = 0: one-way transfers). The timing is rank 1's.
struct NcclPair {
  std::unique_ptr<NcclTransport> ranks[2];
};

Result<NcclPair> MakeNcclPair() {
  RUBATO_ASSIGN_OR_RETURN(std::string id, NcclTransport::NewUniqueId());
  NcclPair pair;
  Status statuses[2];
  std::thread threads[2];
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      auto created =
          NcclTransport::Create({.unique_id = id, .rank = r, .world_size = 2, .device = r});
      if (created.ok()) {
        pair.ranks[r] = std::move(created).value();
      } else {
        statuses[r] = created.status();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const Status& status : statuses) RUBATO_RETURN_IF_ERROR(status);
  return pair;
}

// Runs `rounds` rounds with `in_flight` rounds posted before waiting; returns seconds per round
// seen by rank 1.
Result<double> RunNcclRounds(NcclPair& pair, size_t up, size_t down, int rounds, int in_flight) {
  DeviceBuffer buffers[2][2];  // [rank][0 = send, 1 = receive]
  RUBATO_RETURN_IF_ERROR(Allocate(0, up, buffers[0][0]));
  RUBATO_RETURN_IF_ERROR(Allocate(0, down, buffers[0][1]));
  RUBATO_RETURN_IF_ERROR(Allocate(1, down, buffers[1][0]));
  RUBATO_RETURN_IF_ERROR(Allocate(1, up, buffers[1][1]));
  std::barrier start(2);
  Status statuses[2];
  double seconds = 0;
  std::thread threads[2];
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      (void)cudaSetDevice(r);
      NcclTransport& nccl = *pair.ranks[r];
      const int peer = 1 - r;
      const size_t send_bytes = r == 0 ? up : down;
      const size_t recv_bytes = r == 0 ? down : up;
      std::vector<TransferOp> ops;
      if (send_bytes > 0) {
        ops.push_back(TransferOp::Send(peer, 1, buffers[r][0].data, send_bytes, MemoryKind::kCuda));
      }
      if (recv_bytes > 0) {
        ops.push_back(TransferOp::Recv(peer, 1, buffers[r][1].data, recv_bytes, MemoryKind::kCuda));
      }
      start.arrive_and_wait();
      const auto begin = Clock::now();
      std::vector<TransferId> posted;
      for (int round = 0; round < rounds && statuses[r].ok(); ++round) {
        auto id = nccl.Post(ops);
        if (!id.ok()) {
          statuses[r] = id.status();
          break;
        }
        posted.push_back(*id);
        if (static_cast<int>(posted.size()) == in_flight || round + 1 == rounds) {
          for (TransferId done : posted) {
            const Status waited = nccl.Wait(done, kNcclWait);
            if (!waited.ok()) statuses[r] = waited;
          }
          posted.clear();
        }
      }
      if (r == 1) seconds = std::chrono::duration<double>(Clock::now() - begin).count();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const Status& status : statuses) RUBATO_RETURN_IF_ERROR(status);
  return seconds / rounds;
}

Result<Timing> TimeNccl(NcclPair& pair, size_t bytes, const NcclBenchOptions& options) {
  RUBATO_RETURN_IF_ERROR(RunNcclRounds(pair, bytes, 0, 2, 1).status());  // warm-up
  Timing timing;
  RUBATO_ASSIGN_OR_RETURN(const double one, RunNcclRounds(pair, bytes, 0, options.iterations, 1));
  timing.latency_us = one * 1e6;
  RUBATO_ASSIGN_OR_RETURN(
      const double piped,
      RunNcclRounds(pair, bytes, 0, options.iterations * options.pipeline, options.pipeline));
  timing.bandwidth_gbps = static_cast<double>(bytes) / piped / 1e9;
  return timing;
}

// The layer-pack round trip at Qwen3-8B attention shapes: 32 query heads, 8 KV heads, head_dim
// 128, bf16. Up: one decode token's K, V and q for P layers x B requests. Down: the compact K and
// V of `selected` rows per KV head plus their positions (int32) for the same layers and requests.
constexpr int kQueryHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr size_t kBf16 = 2;

size_t PackUpBytes(int layers, int batch) {
  return static_cast<size_t>(layers) * batch * (2 * kKvHeads + kQueryHeads) * kHeadDim * kBf16;
}
size_t PackDownBytes(int layers, int batch, int selected) {
  const size_t rows = static_cast<size_t>(layers) * batch * kKvHeads * selected;
  return rows * (2 * kHeadDim * kBf16 + sizeof(int32_t));
}

}  // namespace

int CudaDeviceCount() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess ? devices : 0;
}

Status RunNccl(const std::vector<size_t>& sizes, const NcclBenchOptions& options, Json& json) {
  const int devices = CudaDeviceCount();
  if (devices < 2) {
    return UnavailableError("nccl: needs two CUDA devices, found " + std::to_string(devices));
  }
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  int peer_access = 0;
  (void)cudaDeviceCanAccessPeer(&peer_access, 0, 1);
  if (peer_access != 0) {
    (void)cudaSetDevice(0);
    (void)cudaDeviceEnablePeerAccess(1, 0);
    (void)cudaSetDevice(1);
    (void)cudaDeviceEnablePeerAccess(0, 0);
  }
  RUBATO_ASSIGN_OR_RETURN(NcclPair pair, MakeNcclPair());
  json["device"] = std::string(prop.name) + " x" + std::to_string(devices);
  json["peer_access"] = peer_access != 0;
  json["iterations"] = options.iterations;
  json["pipeline"] = options.pipeline;
  std::printf("%10s %14s %14s %8s %14s %14s\n", "bytes", "memcpy GB/s", "nccl GB/s", "ratio",
              "memcpy us", "nccl us");
  for (const size_t bytes : sizes) {
    RUBATO_ASSIGN_OR_RETURN(const Timing memcpy_timing, TimeMemcpyPeer(bytes, options));
    RUBATO_ASSIGN_OR_RETURN(const Timing nccl_timing, TimeNccl(pair, bytes, options));
    const double ratio = nccl_timing.bandwidth_gbps / memcpy_timing.bandwidth_gbps;
    std::printf("%10zu %14.1f %14.1f %8.3f %14.1f %14.1f\n", bytes, memcpy_timing.bandwidth_gbps,
                nccl_timing.bandwidth_gbps, ratio, memcpy_timing.latency_us,
                nccl_timing.latency_us);
    json["sizes"].push_back({{"bytes", bytes},
                             {"memcpy_peer_gbps", memcpy_timing.bandwidth_gbps},
                             {"nccl_gbps", nccl_timing.bandwidth_gbps},
                             {"nccl_over_memcpy", ratio},
                             {"memcpy_peer_latency_us", memcpy_timing.latency_us},
                             {"nccl_latency_us", nccl_timing.latency_us}});
  }

  std::printf("\nlayer-pack round trip, Qwen3-8B shapes, batch %d, %d compact rows per KV head\n",
              options.pack_batch, options.pack_selected);
  std::printf("%4s %12s %14s %14s %14s\n", "P", "up bytes", "down bytes", "round trip ms",
              "down GB/s");
  for (const int layers : options.pack_layers) {
    const size_t up = PackUpBytes(layers, options.pack_batch);
    const size_t down = PackDownBytes(layers, options.pack_batch, options.pack_selected);
    // One pack at a time, both directions in one group per rank: the pack's round trip.
    RUBATO_RETURN_IF_ERROR(RunNcclRounds(pair, up, down, 2, 1).status());  // warm-up
    RUBATO_ASSIGN_OR_RETURN(const double seconds,
                            RunNcclRounds(pair, up, down, options.iterations, 1));
    const double down_gbps = static_cast<double>(down) / seconds / 1e9;
    std::printf("%4d %12zu %14zu %14.3f %14.1f\n", layers, up, down, seconds * 1e3, down_gbps);
    json["layer_packs"].push_back({{"layers", layers},
                                   {"batch", options.pack_batch},
                                   {"selected", options.pack_selected},
                                   {"up_bytes", up},
                                   {"down_bytes", down},
                                   {"round_trip_ms", seconds * 1e3},
                                   {"down_gbps", down_gbps}});
  }
  // AsyncSpade Table 2: the minimal inter-GPU bandwidth for full overlap (Qwen3-8B / 32B,
  // A100 / H100): 105-230 GB/s.
  json["asyncspade_table2_min_bandwidth_gbps"] = {105.20, 229.93};
  return Status::Ok();
}

}  // namespace rubato::bench
