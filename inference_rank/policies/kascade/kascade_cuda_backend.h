// Kascade's backend half on the CUDA model (decode; prefill runs dense on this backend): per
// layer over its decode rows, layer 0 a dense decode attention that also writes raw scores;
// other anchors a scores-only pass (keys only, decode_scores.cuh); on anchors the GQA-pooled
// top-k of every
// row and KV head with a per-row k (kernels/cuda/pooled_top_k.cuh); then, except on layer 0,
// the index-gather decode attention over the anchor's selection through the layer's head map
// (kernels/cuda/index_gather_attention.cuh). All on the main stream, graph-replayable.
#pragma once

#include <memory>

#include "common/status.h"
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/policies/kascade/kascade_policy.h"

namespace rubato {

class CudaModel;

Result<std::unique_ptr<AttentionBackend>> MakeKascadeCudaBackend(CudaModel& model,
                                                                 const KascadePolicy& policy);

}  // namespace rubato
