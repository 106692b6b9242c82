// The `oracle_topk` cache selector (the oracle_topk policy on offloaded KV, `offload_topk`; the
// sequential baseline that AsyncSpade removes). For a one-token entry the reply carries the sink
// [0, sink_end) and the top_k positions of [sink_end, recent_begin) by the GQA-pooled attention
// of the pack's own query (exact, cache_rank/exact_top_k.h), recent_begin = max(0, L -
// recent_tokens), and serves that same step. Prefill chunks (new_tokens > 1) attend locally and
// get an empty reply. With top_k covering the context it equals dense.
#pragma once

#include "cache_rank/cache_selector.h"

namespace rubato {

class OracleTopKCacheSelector final : public CacheSelector {
 public:
  constexpr OracleTopKCacheSelector()
      : CacheSelector("oracle_topk", {.needs_query = true, .serves_same_step = true}) {}

  // top_k >= 1, sink_tokens >= 0, recent_tokens >= 1.
  Status Validate(const CacheSelectorSpec& spec) const override;
  ReplyRange ReplyRangeFor(const CacheSelectorSpec& spec, int first_position,
                           int new_tokens) const override;
  Result<KvHeadSelection> Select(const CacheSelectorSpec& spec, const KvStore& store,
                                 const LayerPackView& pack, uint32_t layer_index,
                                 uint32_t request_index,
                                 CacheSelectorState* /*state*/) const override;
};

extern const OracleTopKCacheSelector kOracleTopKCacheSelector;

}  // namespace rubato
