// Exact token selection on the cache rank (DESIGN §4.5; AsyncSpade §4): for one session and
// layer, score every stored position in a range against a (predicted) query and keep the k
// best per KV head.
//
// Score of query head h on position j: logit q_h . k_j / sqrt(head_dim), softmax per query head
// over the range, then pooled over the query heads of the KV head's GQA group (heads
// [g * G, (g + 1) * G) with G = num_query_heads / num_kv_heads) by the mean of the
// probabilities. AsyncSpade §4 pools over the group but does not fix the operator; the mean of
// the probabilities is our choice (it matches DESIGN §4.2's SFI pooling and keeps every query
// head's distribution on the same scale). All math is fp32; bf16 / f16 keys are converted with
// common/dtype.h.
#pragma once

#include <cstdint>
#include <span>

#include "cache_rank/kv_store.h"
#include "common/status.h"

namespace rubato {

// Returns, per KV head, the min(k, end - begin) positions of [begin, end) with the highest
// pooled score, in ascending position order. Ties go to the lower position; a key whose logit is
// not finite (NaN / inf in the key) counts as logit -inf, ranking below every finite one. `query` is [num_query_heads][head_dim] fp32 and must be
// finite; [begin, end) must lie within the layer's readable tokens (KvStore::LayerLength).
Result<KvHeadSelection> ExactTopK(const KvStore& store, uint64_t session_id, uint32_t layer,
                                  std::span<const float> query, uint32_t k, uint32_t begin,
                                  uint32_t end);

}  // namespace rubato
