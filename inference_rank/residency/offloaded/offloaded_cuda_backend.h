// The offloaded residency's model half on the CUDA model (cuda_residency_backend.h): per layer,
// after the local KV append, its entries' new K/V (and last query) go to their exchange through
// pinned host memory in bf16, and their decode rows take what it returns: the attention output
// the cache rank computed (dense), or a compact selection attended with the recent segment by
// the two-segment kernel (oracle_topk). Synchronous per layer (it waits on the host for the
// exchange), hence not graph-replayable: the path of host cache ranks; a GPU cache rank in this
// process is gpu_cache_residency.h. docs/cuda_model.md "Offloaded entries".
#pragma once

#include <memory>

#include "common/hf_config.h"
#include "inference_rank/residency/cuda_residency_backend.h"

namespace rubato {

std::unique_ptr<CudaResidencyBackend> MakeOffloadedCudaBackend(const ModelConfig& config);

}  // namespace rubato
