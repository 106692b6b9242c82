// SyncKV's backend half on the CUDA model (docs/synckv.md "On the GPU"), over the
// split_by_head residency's device storage (split_by_head_cuda_kv.h). Per layer, on the main
// stream:
//   * decode rows: the NR-heads attend their compact pool and the recent positions (the
//     two-segment decode attention, every KV head at once), then each R-head attends its full
//     KV in its own pool (dense decode attention over one KV head), overwriting its heads' rows;
//   * selection rows (anticipation steps and the prompt's last token): each R-head's scores over
//     the whole context (the scores-only decode attention), its group's softmax max-pooled with
//     the static set excluded (kernels/group_max_probs.cuh), the pooled top-k
//     (kernels/cuda/pooled_top_k.cuh); the prompt's end takes the static set first and the
//     dynamic set after it;
//   * after the layer's attention read the old pool: the pool's bookkeeping of the new sets
//     (residency kernels/head_pool.cuh), the rows still local copied at once, and only the rows
//     not already on the device fetched from the store on the residency's copy stream, which the
//     next step's layer waits for with an event (no host synchronisation in a step).
#pragma once

#include <memory>

#include "common/status.h"
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/model/cuda_model.h"

namespace rubato {

class SyncKvPolicy;

Result<std::unique_ptr<AttentionBackend>> MakeSyncKvCudaBackend(CudaModel& model,
                                                                const SyncKvPolicy& policy);

}  // namespace rubato
