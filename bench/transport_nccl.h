// The two-GPU part of rubato_bench_transport (bench/transport.cc): NCCL P2P through
// NcclTransport beside cudaMemcpyPeerAsync, then the layer-pack round trips. NCCL builds only.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace rubato::bench {

struct NcclBenchOptions {
  int iterations = 20;
  int pipeline = 8;
  std::vector<int> pack_layers = {4, 6, 12};
  int pack_batch = 8;
  int pack_selected = 2048;  // compact rows per KV head the reply carries (AsyncSpade: top-2k)
};

// CUDA devices visible to this process (0 when the runtime finds none).
int CudaDeviceCount();

// NCCL against cudaMemcpyPeer at each size, then the layer packs; fills `json` with what was
// measured, also when it fails part-way.
Status RunNccl(const std::vector<size_t>& sizes, const NcclBenchOptions& options,
               nlohmann::json& json);

}  // namespace rubato::bench
