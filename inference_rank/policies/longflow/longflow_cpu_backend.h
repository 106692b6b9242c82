// LongFlow's backend half on the CPU model: per layer, it keeps the prompt's latest queries
// (BeforeAttention), moves a finished prompt into the request's slots, SnapKV-compressed when
// longer than the budget (AfterAttention), and runs each decode token's fixed-budget attention
// over the slots with the choice of the next write slot (AttendFixedBudget). The step itself is
// LongFlowDecodeStep, which tests drive directly.
#pragma once

#include <memory>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/kv/slot_kv_pool.h"
#include "inference_rank/policies/longflow/longflow_policy.h"
#include "kernels/cpu/thread_pool.h"

namespace rubato {

Result<std::unique_ptr<AttentionBackend>> MakeLongFlowCpuBackend(const ModelConfig& model,
                                                                 const LongFlowConfig& config);

// Per-worker scratch of the steps below, grown as needed.
using LongFlowScratch = std::vector<std::vector<float>>;

// One decode token's attention in one layer, after its K/V went into the slots next_slot named
// (slots `occupied_before` valid before the write, filled in slot order until the budget is
// full). Writes `output` ([num_heads][head_dim]) and next_slot per KV head; returns true when
// the write evicted a token. While nothing has been evicted the slots hold positions 0, 1, ...
// in order and the attention is the dense op's over them (bit for bit dense attention); the
// fused op (kernels/cpu/longflow_attention.h) chooses the next slot once the budget is full and
// gives the output from the first eviction on.
Result<bool> LongFlowDecodeStep(const SlotKvView& slots, int occupied_before, int sink_tokens,
                                int num_heads, const float* query, float* output, ThreadPool& pool,
                                LongFlowScratch& scratch);

// The next write slot of every KV head once the budget is full: the fused op's argmin for
// `query` ([num_heads][head_dim], the latest token's), its output discarded.
Status ChooseNextSlots(const SlotKvView& slots, int sink_tokens, int num_heads, const float* query,
                       ThreadPool& pool, LongFlowScratch& scratch);

}  // namespace rubato
