// Oracle top-k's backend half on the CPU model: before each layer's attention, for every
// kTwoSegment entry, the logits of its query over the candidates, the GQA-pooled top-k
// (kernels/cpu/pooled_top_k.h) and the gather of sink + selected rows into the entry's compact
// buffer, which the entry then attends with its recent segment (two-segment op).
#pragma once

#include <memory>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"

namespace rubato {

Result<std::unique_ptr<AttentionBackend>> MakeOracleTopKCpuBackend(const ModelConfig& model,
                                                                   const OracleTopKConfig& config);

// TESTS: the positions batch entry `entry`'s compact buffer holds after the last layer that
// selected for it, per KV head (sink then selected, ascending). `backend` must come from
// MakeOracleTopKCpuBackend.
const std::vector<std::vector<int>>& OracleTopKKeptForTest(const AttentionBackend& backend,
                                                           int entry);

}  // namespace rubato
