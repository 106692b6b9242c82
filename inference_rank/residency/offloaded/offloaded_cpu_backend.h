// The offloaded residency's model half on the CPU model (cpu_residency_backend.h): per layer,
// its entries' new K/V and last query go to their exchange (kv_offload.h), and each decode token
// past position 0 attends the compact KV the exchange returns plus the local recent segment
// (two segments); prefill chunks attend the paged cache. docs/disaggregated.md.
#pragma once

#include <memory>

#include "common/hf_config.h"
#include "inference_rank/residency/cpu_residency_backend.h"

namespace rubato {

std::unique_ptr<CpuResidencyBackend> MakeOffloadedCpuBackend(const ModelConfig& config);

}  // namespace rubato
