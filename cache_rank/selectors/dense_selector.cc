// DenseCacheSelector (dense_selector.h).
#include "cache_rank/selectors/dense_selector.h"

#include <numeric>

namespace rubato {

constinit const DenseCacheSelector kDenseCacheSelector;

// Dense has no parameters; the spec's numbers are oracle_topk's and go unread.
Status DenseCacheSelector::Validate(const CacheSelectorSpec& /*spec*/) const {
  return Status::Ok();
}

// Every position [0, L), L = first_position + new_tokens, prefill chunks included.
ReplyRange DenseCacheSelector::ReplyRangeFor(const CacheSelectorSpec& /*spec*/, int first_position,
                                             int new_tokens) const {
  const int length = first_position + new_tokens;
  return {0, length, length};
}

Result<KvHeadSelection> DenseCacheSelector::Select(const CacheSelectorSpec& spec,
                                                   const KvStore& /*store*/,
                                                   const LayerPackView& pack,
                                                   uint32_t /*layer_index*/,
                                                   uint32_t request_index) const {
  const LayerPackRequest& request = pack.requests()[request_index];
  const ReplyRange range = ReplyRangeFor(spec, static_cast<int>(request.first_position),
                                         static_cast<int>(request.new_tokens));
  KvHeadSelection selection(pack.num_kv_heads(),
                            std::vector<int32_t>(static_cast<size_t>(range.slots)));
  for (std::vector<int32_t>& positions : selection) {
    std::iota(positions.begin(), positions.end(), 0);
  }
  return selection;
}

}  // namespace rubato
