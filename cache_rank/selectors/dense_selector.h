// The `dense` cache selector (the dense policy on offloaded KV, `offload_dense`): a reply carries
// every position of the request after the pack's append, and serves the request's next step,
// whose recent segment is then its new token alone. Equals dense attention.
#pragma once

#include "cache_rank/cache_selector.h"

namespace rubato {

class DenseCacheSelector final : public CacheSelector {
 public:
  constexpr DenseCacheSelector() : CacheSelector("dense", {}) {}

  Status Validate(const CacheSelectorSpec& spec) const override;
  ReplyRange ReplyRangeFor(const CacheSelectorSpec& spec, int first_position,
                           int new_tokens) const override;
  Result<KvHeadSelection> Select(const CacheSelectorSpec& spec, const KvStore& store,
                                 const LayerPackView& pack, uint32_t layer_index,
                                 uint32_t request_index) const override;
};

extern const DenseCacheSelector kDenseCacheSelector;

}  // namespace rubato
