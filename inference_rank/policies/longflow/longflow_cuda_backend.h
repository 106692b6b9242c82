// LongFlow's backend half on the CUDA model. Per layer of a decode step, over its fixed-budget
// rows: each token's K/V into the slot its array's next_slot names (kernels/cuda/slot_writes.cuh),
// then the fused attention (kernels/cuda/longflow_attention.cuh), which gives the output and
// writes each KV head's next slot back on the device: a step is graph-replayable. At the end of a
// prompt: the prompt moves into the slots, every position within the budget, else SnapKV-scored
// (kernels/cuda/snapkv_scores.cuh), top-k (pooled_top_k.cuh) and gathered (compact_gather.cuh);
// when the slots are full, the fused op on the prompt's last query chooses the first decode slot.
// Counters from the known fill state on the host (docs/longflow.md "The CUDA half").
#pragma once

#include <memory>

#include "common/status.h"
#include "inference_rank/attention/attention_backend.h"
#include "inference_rank/policies/longflow/longflow_policy.h"

namespace rubato {

class CudaModel;

Result<std::unique_ptr<AttentionBackend>> MakeLongFlowCudaBackend(CudaModel& model,
                                                                  const LongFlowConfig& config);

}  // namespace rubato
