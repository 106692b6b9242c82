// Kascade's backend half on the CUDA model. Decode: per layer over its decode rows, layer 0 a
// dense decode attention that also writes raw scores; other anchors a scores-only pass (keys
// only, decode_scores.cuh); on anchors the GQA-pooled top-k of every row and KV head with a
// per-row k (kernels/cuda/pooled_top_k.cuh); then, except on layer 0, the index-gather decode
// attention over the anchor's selection through the layer's head map
// (kernels/cuda/index_gather_attention.cuh). All on the main stream, graph-replayable. Prefill
// (`prefill: tiled`): the chunks with its plan, tile-sparse (kascade_cuda_prefill.h).
#pragma once

#include <memory>
#include <vector>

#include "common/status.h"
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/policies/kascade/kascade_policy.h"

namespace rubato {

class CudaModel;

Result<std::unique_ptr<AttentionBackend>> MakeKascadeCudaBackend(CudaModel& model,
                                                                 const KascadePolicy& policy);

// The last forward's prefill selections of `anchor_layer` (per tile in chunk order and KV head,
// ascending positions), read back from the device; for tests against the CPU backend's.
Result<std::vector<std::vector<int>>> KascadeCudaPrefillSelectionsForTest(
    const AttentionBackend& backend, int anchor_layer);

}  // namespace rubato
