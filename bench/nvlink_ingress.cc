// rubato_bench_nvlink_ingress: what one GPU's links take when several peers send to it at once
// (an inference rank's GPU receiving from three cache GPUs), and give when it sends to them all.
// For each size: every peer alone, then every peer at once, by cudaMemcpyPeerAsync on a stream
// of the sending GPU, timed on the host around the whole batch of copies. Bandwidths in GB/s
// (1e9 bytes). A benchmark, not a test: it measures and never asserts. docs/benchmarks.md
// "NVLink ingress".
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "bench/decode_bench_common.h"
#include "common/status.h"
#include "kernels/cuda/cuda_status.h"

namespace rubato {
namespace {

struct Options {
  bench::CommonOptions common;  // device (the receiving GPU), commit, out; no model
  std::vector<int> peers;       // empty: every other GPU
  std::vector<size_t> sizes = {size_t{64} << 20, size_t{256} << 20, size_t{1} << 30};
  int rounds = 10;
};

// One direction's buffers: per peer, a source and a destination of the largest size.
struct Link {
  int peer = 0;
  void* on_peer = nullptr;
  void* on_target = nullptr;
  cudaStream_t peer_stream = nullptr;    // copies the peer sends (ingress)
  cudaStream_t target_stream = nullptr;  // copies the target sends (egress)
};

Status SyncAll(const std::vector<Link>& links) {
  for (const Link& link : links) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(link.peer_stream), "waiting for copies");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(link.target_stream), "waiting for copies");
  }
  return Status::Ok();
}

// GB/s of `rounds` copies of `bytes` over each link of `which` at once, in one direction.
Result<double> Copy(std::vector<Link>& links, const std::vector<size_t>& which, int target,
                    size_t bytes, int rounds, bool ingress) {
  RUBATO_RETURN_IF_ERROR(SyncAll(links));
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < rounds; ++round) {
    for (const size_t i : which) {
      Link& link = links[i];
      const cudaError_t queued = ingress
                                     ? cudaMemcpyPeerAsync(link.on_target, target, link.on_peer,
                                                           link.peer, bytes, link.peer_stream)
                                     : cudaMemcpyPeerAsync(link.on_peer, link.peer, link.on_target,
                                                           target, bytes, link.target_stream);
      RUBATO_CUDA_RETURN_IF_ERROR(queued, "queueing a peer copy");
    }
  }
  RUBATO_RETURN_IF_ERROR(SyncAll(links));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(bytes) * rounds * static_cast<double>(which.size()) / seconds / 1e9;
}

Status Run(const Options& options, nlohmann::json& report) {
  int devices = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&devices), "counting CUDA devices");
  const int target = options.common.device;
  std::vector<int> peers = options.peers;
  if (peers.empty()) {
    for (int d = 0; d < devices; ++d) {
      if (d != target) peers.push_back(d);
    }
  }
  if (target < 0 || target >= devices) {
    return InvalidArgumentError("--device " + std::to_string(target) + " of " +
                                std::to_string(devices) + " GPUs");
  }
  if (peers.empty()) return InvalidArgumentError("no peer GPU: this machine has one");
  if (options.rounds < 1) return InvalidArgumentError("--rounds must be >= 1");
  size_t largest = 0;
  for (const size_t size : options.sizes) largest = std::max(largest, size);
  std::vector<Link> links;
  Status status;
  for (const int peer : peers) {
    if (peer < 0 || peer >= devices || peer == target) {
      status =
          InvalidArgumentError("--peers: GPU " + std::to_string(peer) + " (target " +
                               std::to_string(target) + ", " + std::to_string(devices) + " GPUs)");
      break;
    }
    Link link;
    link.peer = peer;
    for (const auto& [device, other, buffer, stream] :
         {std::tuple{peer, target, &link.on_peer, &link.peer_stream},
          std::tuple{target, peer, &link.on_target, &link.target_stream}}) {
      if (!status.ok()) break;
      status = cuda::CudaStatus(cudaSetDevice(device), "selecting a GPU");
      if (status.ok()) {
        const cudaError_t enabled = cudaDeviceEnablePeerAccess(other, 0);
        if (enabled != cudaErrorPeerAccessAlreadyEnabled) {
          status = cuda::CudaStatus(enabled, "enabling peer access");
        }
        (void)cudaGetLastError();
      }
      if (status.ok()) status = cuda::CudaStatus(cudaMalloc(buffer, largest), "allocating");
      if (status.ok()) {
        status = cuda::CudaStatus(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking),
                                  "creating a stream");
      }
    }
    links.push_back(link);
    if (!status.ok()) break;
  }
  std::vector<size_t> all(links.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  nlohmann::json points = nlohmann::json::array();
  std::printf("%12s %9s %s\n", "bytes", "direction", "GB/s: each peer alone | all at once");
  for (size_t s = 0; s < options.sizes.size() && status.ok(); ++s) {
    const size_t bytes = options.sizes[s];
    for (const bool ingress : {true, false}) {
      nlohmann::json point = {{"bytes", bytes},
                              {"direction", ingress ? "ingress" : "egress"},
                              {"rounds", options.rounds}};
      double sum_alone = 0;
      std::string line;
      for (size_t i = 0; i < links.size() && status.ok(); ++i) {
        (void)Copy(links, {i}, target, bytes, 1, ingress);  // warm-up
        Result<double> alone = Copy(links, {i}, target, bytes, options.rounds, ingress);
        if (!alone.ok()) {
          status = alone.status();
          break;
        }
        point["alone_gbps"][std::to_string(links[i].peer)] = *alone;
        sum_alone += *alone;
        line += " " + std::to_string(static_cast<int>(*alone));
      }
      if (!status.ok()) break;
      Result<double> together = Copy(links, all, target, bytes, options.rounds, ingress);
      if (!together.ok()) {
        status = together.status();
        break;
      }
      point["together_gbps"] = *together;
      point["together_over_sum_alone"] = *together / sum_alone;
      std::printf("%12zu %9s%s | %.1f (%.2fx the sum alone)\n", bytes,
                  ingress ? "ingress" : "egress", line.c_str(), *together, *together / sum_alone);
      points.push_back(point);
    }
  }
  for (const Link& link : links) {
    (void)cudaSetDevice(link.peer);
    if (link.on_peer != nullptr) cudaFree(link.on_peer);
    if (link.peer_stream != nullptr) cudaStreamDestroy(link.peer_stream);
    (void)cudaSetDevice(target);
    if (link.on_target != nullptr) cudaFree(link.on_target);
    if (link.target_stream != nullptr) cudaStreamDestroy(link.target_stream);
  }
  RUBATO_RETURN_IF_ERROR(status);
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, target);
  report["benchmark"] = "nvlink_ingress";
  report["device"] = prop.name;
  report["gpus"] = devices;
  report["target"] = target;
  report["peers"] = peers;
  report["commit"] =
      options.common.commit.empty() ? std::string(RUBATO_GIT_COMMIT) : options.common.commit;
  report["command"] = options.common.command_line;
  report["method"] =
      "cudaMemcpyPeerAsync on a stream of the sending GPU (ingress: each peer sends to the target; "
      "egress: the target sends to each peer), `rounds` copies per link, host wall clock around "
      "the batch after a one-copy warm-up; GB/s = 1e9 bytes/s";
  report["points"] = points;
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"NVLink ingress and egress of one GPU with several peers at once"};
  app.add_option("--device", options.common.device, "the receiving GPU");
  app.add_option("--commit", options.common.commit, "commit to record (default: the build's)");
  app.add_option("--out", options.common.out, "JSON report path");
  app.add_option("--peers", options.peers, "sending GPUs (default: every other GPU)")
      ->delimiter(',');
  app.add_option("--sizes", options.sizes, "bytes per copy")->delimiter(',');
  app.add_option("--rounds", options.rounds, "copies per link and size");
  return rubato::bench::BenchMain("rubato_bench_nvlink_ingress", app, options.common, argc, argv,
                                  [&](nlohmann::json& report) { return Run(options, report); });
}
