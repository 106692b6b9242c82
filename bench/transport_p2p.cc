// Transport bandwidth and latency between two GPUs of one host (issue #6 benchmark; DESIGN §8
// "Disaggregated"): for each message size, NCCL P2P through rubato's NcclTransport (one rank a
// thread, one GPU each) beside cudaMemcpyPeerAsync between the same GPUs, and the layer-pack
// round trip of the AsyncSpade design (a KV pack of P layers up, the compact KV of the same
// layers back) at Qwen3-8B shapes, compared with the bandwidth AsyncSpade's Table 2 says full
// overlap needs. Writes JSON; prints a table.
//
//   rubato_bench_transport --out bench/results/transport_p2p_h200.json
//
// Bandwidth is measured with `--pipeline` transfers in flight back to back (what a stream of
// packs sees); latency with one transfer at a time, posted and waited for on the host (what a
// synchronous round trip sees).
#include <cuda_runtime_api.h>

#include <barrier>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/status.h"
#include "kernels/cuda/cuda_status.h"
#include "transport/nccl_transport.h"

namespace rubato {
namespace {

using transport::MemoryKind;
using transport::NcclTransport;
using transport::TransferId;
using transport::TransferOp;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kWaitTimeout{60000};

struct Options {
  std::vector<std::string> sizes = {"4K",  "16K", "64K", "256K", "1M",  "4M",
                                    "16M", "64M", "256M", "1G"};
  int iterations = 20;
  int pipeline = 8;
  std::vector<int> pack_layers = {4, 6, 12};
  int pack_batch = 8;
  int pack_selected = 2048;  // compact rows per KV head the reply carries (AsyncSpade: top-2k)
  std::string out;
  std::string commit = "unknown";
};

Result<size_t> ParseSize(const std::string& text) {
  size_t multiplier = 1;
  std::string digits = text;
  if (!text.empty()) {
    const char unit = text.back();
    if (unit == 'K' || unit == 'M' || unit == 'G') {
      multiplier = unit == 'K' ? (1u << 10) : unit == 'M' ? (1u << 20) : (1u << 30);
      digits = text.substr(0, text.size() - 1);
    }
  }
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) {
    return InvalidArgumentError("--sizes: '" + text + "' is not a size like 4096, 64K, 16M, 1G");
  }
  return static_cast<size_t>(std::stoull(digits)) * multiplier;
}

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

// ---- cudaMemcpyPeer ----------------------------------------------------------------------------

struct Timing {
  double bandwidth_gbps = 0;  // bytes / second / 1e9, pipelined
  double latency_us = 0;      // one transfer at a time, host-observed
};

Result<Timing> TimeMemcpyPeer(size_t bytes, const Options& options) {
  DeviceBuffer source, destination;
  RUBATO_RETURN_IF_ERROR(Allocate(0, bytes, source));
  RUBATO_RETURN_IF_ERROR(Allocate(1, bytes, destination));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(1), "device 1");
  cudaStream_t stream = nullptr;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const auto copy = [&] { return cudaMemcpyPeerAsync(destination.data, 1, source.data, 0, bytes,
                                                     stream); };
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

// ---- NCCL through NcclTransport ----------------------------------------------------------------

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
      auto created = NcclTransport::Create({.unique_id = id, .rank = r, .world_size = 2,
                                            .device = r});
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
      if (send_bytes > 0) ops.push_back(TransferOp::Send(peer, 1, buffers[r][0].data, send_bytes,
                                                        MemoryKind::kCuda));
      if (recv_bytes > 0) ops.push_back(TransferOp::Recv(peer, 1, buffers[r][1].data, recv_bytes,
                                                        MemoryKind::kCuda));
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
            const Status waited = nccl.Wait(done, kWaitTimeout);
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

Result<Timing> TimeNccl(NcclPair& pair, size_t bytes, const Options& options) {
  RUBATO_RETURN_IF_ERROR(RunNcclRounds(pair, bytes, 0, 2, 1).status());  // warm-up
  Timing timing;
  RUBATO_ASSIGN_OR_RETURN(const double one, RunNcclRounds(pair, bytes, 0, options.iterations, 1));
  timing.latency_us = one * 1e6;
  RUBATO_ASSIGN_OR_RETURN(const double piped,
                          RunNcclRounds(pair, bytes, 0, options.iterations * options.pipeline,
                                        options.pipeline));
  timing.bandwidth_gbps = static_cast<double>(bytes) / piped / 1e9;
  return timing;
}

// ---- the layer-pack round trip at Qwen3-8B shapes ----------------------------------------------

// Qwen3-8B attention: 32 query heads, 8 KV heads, head_dim 128, bf16.
constexpr int kQueryHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr size_t kBf16 = 2;

// Up: one decode token's K, V and q for P layers x B requests. Down: the compact K and V of
// `selected` rows per KV head plus their positions (int32) for the same layers and requests.
size_t PackUpBytes(int layers, int batch) {
  return static_cast<size_t>(layers) * batch * (2 * kKvHeads + kQueryHeads) * kHeadDim * kBf16;
}
size_t PackDownBytes(int layers, int batch, int selected) {
  const size_t rows = static_cast<size_t>(layers) * batch * kKvHeads * selected;
  return rows * (2 * kHeadDim * kBf16 + sizeof(int32_t));
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  using namespace rubato;
  Options options;
  CLI::App app("Transport bandwidth / latency between two GPUs, and layer-pack round trips");
  app.add_option("--sizes", options.sizes, "message sizes (4096, 64K, 16M, 1G)");
  app.add_option("--iterations", options.iterations, "timed transfers per size")
      ->check(CLI::Range(1, 100000));
  app.add_option("--pipeline", options.pipeline, "transfers in flight for bandwidth")
      ->check(CLI::Range(1, 1024));
  app.add_option("--pack-layers", options.pack_layers, "layers per pack (P)");
  app.add_option("--pack-batch", options.pack_batch, "requests per pack")
      ->check(CLI::Range(1, 1024));
  app.add_option("--pack-selected", options.pack_selected, "compact rows per KV head")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--out", options.out, "write the results as JSON here");
  app.add_option("--commit", options.commit, "commit recorded in the JSON");
  CLI11_PARSE(app, argc, argv);

  const auto fail = [](const Status& status) {
    std::fprintf(stderr, "rubato_bench_transport: error: %s\n", status.message().c_str());
    return 1;
  };
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    return fail(UnavailableError("needs two CUDA devices, found " + std::to_string(devices)));
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
  auto pair = MakeNcclPair();
  if (!pair.ok()) return fail(pair.status());

  nlohmann::json json;
  json["device"] = std::string(prop.name) + " x" + std::to_string(devices);
  json["peer_access"] = peer_access != 0;
  json["commit"] = options.commit;
  json["iterations"] = options.iterations;
  json["pipeline"] = options.pipeline;
  std::printf("%10s %14s %14s %8s %14s %14s\n", "bytes", "memcpy GB/s", "nccl GB/s", "ratio",
              "memcpy us", "nccl us");
  for (const std::string& text : options.sizes) {
    auto bytes = ParseSize(text);
    if (!bytes.ok()) return fail(bytes.status());
    auto memcpy_timing = TimeMemcpyPeer(*bytes, options);
    if (!memcpy_timing.ok()) return fail(memcpy_timing.status());
    auto nccl_timing = TimeNccl(*pair, *bytes, options);
    if (!nccl_timing.ok()) return fail(nccl_timing.status());
    const double ratio = nccl_timing->bandwidth_gbps / memcpy_timing->bandwidth_gbps;
    std::printf("%10zu %14.1f %14.1f %8.3f %14.1f %14.1f\n", *bytes,
                memcpy_timing->bandwidth_gbps, nccl_timing->bandwidth_gbps, ratio,
                memcpy_timing->latency_us, nccl_timing->latency_us);
    json["sizes"].push_back({{"bytes", *bytes},
                             {"memcpy_peer_gbps", memcpy_timing->bandwidth_gbps},
                             {"nccl_gbps", nccl_timing->bandwidth_gbps},
                             {"nccl_over_memcpy", ratio},
                             {"memcpy_peer_latency_us", memcpy_timing->latency_us},
                             {"nccl_latency_us", nccl_timing->latency_us}});
  }

  std::printf("\nlayer-pack round trip, Qwen3-8B shapes, batch %d, %d compact rows per KV head\n",
              options.pack_batch, options.pack_selected);
  std::printf("%4s %12s %14s %14s %14s\n", "P", "up bytes", "down bytes", "round trip ms",
              "down GB/s");
  for (const int layers : options.pack_layers) {
    const size_t up = PackUpBytes(layers, options.pack_batch);
    const size_t down = PackDownBytes(layers, options.pack_batch, options.pack_selected);
    // One pack at a time, both directions in one group per rank: the pack's round trip.
    auto warm = RunNcclRounds(*pair, up, down, 2, 1);
    if (!warm.ok()) return fail(warm.status());
    auto seconds = RunNcclRounds(*pair, up, down, options.iterations, 1);
    if (!seconds.ok()) return fail(seconds.status());
    const double down_gbps = static_cast<double>(down) / *seconds / 1e9;
    std::printf("%4d %12zu %14zu %14.3f %14.1f\n", layers, up, down, *seconds * 1e3, down_gbps);
    json["layer_packs"].push_back({{"layers", layers},
                                   {"batch", options.pack_batch},
                                   {"selected", options.pack_selected},
                                   {"up_bytes", up},
                                   {"down_bytes", down},
                                   {"round_trip_ms", *seconds * 1e3},
                                   {"down_gbps", down_gbps}});
  }
  // AsyncSpade Table 2: the minimal inter-GPU bandwidth for full overlap (Qwen3-8B / 32B,
  // A100 / H100): 105-230 GB/s.
  json["asyncspade_table2_min_bandwidth_gbps"] = {105.20, 229.93};
  if (!options.out.empty()) {
    std::ofstream out(options.out);
    out << json.dump(2) << "\n";
    if (!out) return fail(IoError("cannot write " + options.out));
  }
  return 0;
}
