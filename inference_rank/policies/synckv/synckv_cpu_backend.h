// SyncKV's backend half on the CPU model: before a layer's attention, for the prompt's last
// token (Eq. 3-4) and for every anticipation step (Eq. 5-6), each cluster's R-head attention
// over every position (GQA group max-pooled, as the clustering of App. B.1), its top-k, handed to
// the request's split_by_head KV (split_by_head_kv.h), which moves the rows.
#pragma once

#include <memory>

#include "common/hf_config.h"
#include "inference_rank/attention/attention_backend.h"

namespace rubato {

class SyncKvPolicy;

std::unique_ptr<AttentionBackend> MakeSyncKvCpuBackend(const ModelConfig& model,
                                                       const SyncKvPolicy& policy);

// The top `k` positions of `scores` (ties to the lower position) not in `excluded` (ascending),
// in descending score order.
std::vector<int> SyncKvTopK(const std::vector<float>& scores, int k,
                            const std::vector<int>& excluded);

}  // namespace rubato
