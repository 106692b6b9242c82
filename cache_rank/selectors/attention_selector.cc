// AttentionCacheSelector (attention_selector.h).
#include "cache_rank/selectors/attention_selector.h"

namespace rubato {

constinit const AttentionCacheSelector kAttentionCacheSelector;

// No parameters; the spec's numbers are oracle_topk's and go unread.
Status AttentionCacheSelector::Validate(const CacheSelectorSpec& /*spec*/) const {
  return Status::Ok();
}

// A decode token: no rows, the attention of its query. A prefill chunk: nothing.
ReplyRange AttentionCacheSelector::ReplyRangeFor(const CacheSelectorSpec& /*spec*/,
                                                 int first_position, int new_tokens) const {
  const int length = first_position + new_tokens;
  return {.sink_end = 0,
          .recent_begin = length,
          .slots = 0,
          .attention_queries = new_tokens == 1 ? 1 : 0};
}

Result<KvHeadSelection> AttentionCacheSelector::Select(
    const CacheSelectorSpec& /*spec*/, const KvStore& /*store*/, const LayerPackView& pack,
    uint32_t /*layer_index*/, uint32_t /*request_index*/, CacheSelectorState* /*state*/) const {
  return KvHeadSelection(pack.num_kv_heads());
}

}  // namespace rubato
