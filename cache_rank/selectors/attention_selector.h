// The `attention` cache selector (the dense policy on offloaded KV): the cache rank attends for
// the inference rank. A one-token entry's reply is the attention of the pack's query over every
// stored position [0, L), the new token's included: its output [num_heads][head_dim] and
// log-sum-exp [num_heads], f32 (cache_rank/stored_attention.h), a few KB per layer whatever L.
// It serves that same step. Prefill chunks attend locally and get an empty reply. Equals dense
// attention.
#pragma once

#include "cache_rank/cache_selector.h"

namespace rubato {

class AttentionCacheSelector final : public CacheSelector {
 public:
  constexpr AttentionCacheSelector()
      : CacheSelector("attention",
                      {.needs_query = true, .serves_same_step = true, .partial_attention = true}) {}

  Status Validate(const CacheSelectorSpec& spec) const override;
  ReplyRange ReplyRangeFor(const CacheSelectorSpec& spec, int first_position,
                           int new_tokens) const override;
  // No rows: an empty list per KV head.
  Result<KvHeadSelection> Select(const CacheSelectorSpec& spec, const KvStore& store,
                                 const LayerPackView& pack, uint32_t layer_index,
                                 uint32_t request_index,
                                 CacheSelectorState* /*state*/) const override;
};

extern const AttentionCacheSelector kAttentionCacheSelector;

}  // namespace rubato
