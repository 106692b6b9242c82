// The offloaded residency's model half on the CUDA model (cuda_residency_backend.h): per layer,
// after the local KV append, its entries' new K/V (and last query) go to their exchange through
// pinned host memory, and their decode rows attend what it returns: a whole prefix as paged
// blocks with the dense kernel (local dense's bits), a compact selection plus the recent segment
// with the two-segment kernel. Synchronous per layer (it waits on the host for the exchange),
// hence not graph-replayable: the correctness path. docs/cuda_model.md "Offloaded entries".
#pragma once

#include <memory>

#include "common/hf_config.h"
#include "inference_rank/residency/cuda_residency_backend.h"

namespace rubato {

std::unique_ptr<CudaResidencyBackend> MakeOffloadedCudaBackend(const ModelConfig& config);

}  // namespace rubato
