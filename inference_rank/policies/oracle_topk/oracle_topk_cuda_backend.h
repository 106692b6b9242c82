// Oracle top-k's backend half on the CUDA model: per layer, over its decode rows, a dense
// decode attention pass that writes the raw scores, the GQA-pooled top-k of every row and KV
// head (kernels/cuda/pooled_top_k.cuh), the gather of sink + selected rows into per-row compact
// buffers, then the two-segment decode attention that gives the rows' output. All on the main
// stream, graph-replayable.
#pragma once

#include <memory>

#include "common/status.h"
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"

namespace rubato {

class CudaModel;

Result<std::unique_ptr<AttentionBackend>> MakeOracleTopKCudaBackend(CudaModel& model,
                                                                    const OracleTopKConfig& config,
                                                                    int max_batch);

}  // namespace rubato
