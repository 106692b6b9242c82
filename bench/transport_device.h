// The device-pack part of rubato_bench_transport (bench/transport.cc, `--backend device`): one-way
// latency (ping-pong / 2) and bandwidth of device buffers from 4 KB to 1 GB over the
// stream-ordered paths: NCCL (Enqueue, a captured graph, and Post / Wait for comparison)
// against cudaMemcpyPeerAsync on two GPUs, and cuda_peer on two GPUs or, with one, two ranks on
// it. Points that need two GPUs are listed by name as not run when there is one. CUDA builds
// with NCCL only.
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "common/status.h"

namespace rubato::bench {

struct DeviceBenchOptions {
  int max_rounds = 200;   // ping-pong rounds / pipelined copies per size, fewer for large sizes
  int graph_rounds = 20;  // ping-pong rounds captured in one graph
};

// Fills `json` with "points" (per size: bytes, rounds, <series>_one_way_us and the bandwidths
// memcpy_peer_gbps, nccl_gbps, cuda_peer_gbps, nccl_over_memcpy), "not_run" (name, why) and
// "acceptance" (the worst NCCL figures against the targets); also when it fails part-way.
Status RunDevicePacks(const std::vector<size_t>& sizes, const DeviceBenchOptions& options,
                      nlohmann::json& json);

}  // namespace rubato::bench
