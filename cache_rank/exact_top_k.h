// Exact token selection on the cache rank: for one session and layer, score every stored
// position in a range against a (predicted) query and keep the k best per KV head: softmax of
// q·k / sqrt(head_dim) per query head over the range, pooled over the GQA group by the mean of
// the probabilities (our choice). fp32; bf16 / f16 keys converted with common/dtype.h.
// Narrative: docs/disaggregated.md "Exact top-k on the cache rank".
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
