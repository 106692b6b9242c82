// Kascade on the CPU model: before an anchor layer's attention, each planned entry's top-k per
// KV head (decode: from its query's GQA-pooled post-softmax probabilities; prefill: per query
// tile, pooled over the tile too); the positions each layer's index or tile gather attends,
// through the head map (kascade_policy.h).
#pragma once

#include <memory>
#include <vector>

#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/policies/kascade/kascade_policy.h"

namespace rubato {

Result<std::unique_ptr<AttentionBackend>> MakeKascadeCpuBackend(const ModelConfig& model,
                                                                const KascadePolicy& policy);

// Tests: the positions batch entry `entry` selected on anchor `layer` in the last forward,
// [tile * kv_heads + kv_head] (one tile for a decode token), each ascending.
const std::vector<std::vector<int>>& KascadeSelectionForTest(const AttentionBackend& backend,
                                                             int entry, int layer);

}  // namespace rubato
