// OracleTopKCacheSelector (oracle_topk_selector.h).
#include "cache_rank/selectors/oracle_topk_selector.h"

#include <algorithm>
#include <span>
#include <string>

#include "cache_rank/exact_top_k.h"
#include "common/dtype.h"

namespace rubato {

constinit const OracleTopKCacheSelector kOracleTopKCacheSelector;

Status OracleTopKCacheSelector::Validate(const CacheSelectorSpec& spec) const {
  const auto below = [&](const char* field, int value, int minimum) {
    return InvalidArgumentError("cache rank: selector " + std::string(name()) + ": " + field +
                                " must be >= " + std::to_string(minimum) + ", got " +
                                std::to_string(value));
  };
  if (spec.top_k < 1) return below("top_k", spec.top_k, 1);
  if (spec.sink_tokens < 0) return below("sink_tokens", spec.sink_tokens, 0);
  if (spec.recent_tokens < 1) return below("recent_tokens", spec.recent_tokens, 1);
  return Status::Ok();
}

ReplyRange OracleTopKCacheSelector::ReplyRangeFor(const CacheSelectorSpec& spec, int first_position,
                                                  int new_tokens) const {
  const int length = first_position + new_tokens;
  if (new_tokens != 1) return {0, length, 0};
  const int recent_begin = std::max(0, length - spec.recent_tokens);
  const int sink_end = std::min(spec.sink_tokens, recent_begin);
  return {sink_end, recent_begin, sink_end + std::min(spec.top_k, recent_begin - sink_end)};
}

// The sink, then the exact top-k of [sink_end, recent_begin) by the pack's query.
Result<KvHeadSelection> OracleTopKCacheSelector::Select(const CacheSelectorSpec& spec,
                                                        const KvStore& store,
                                                        const LayerPackView& pack,
                                                        uint32_t layer_index,
                                                        uint32_t request_index,
                                 CacheSelectorState* /*state*/) const {
  const LayerPackRequest& request = pack.requests()[request_index];
  const ReplyRange range = ReplyRangeFor(spec, static_cast<int>(request.first_position),
                                         static_cast<int>(request.new_tokens));
  const uint32_t kv_heads = pack.num_kv_heads();
  KvHeadSelection selection(kv_heads);
  if (range.slots == 0) return selection;
  const std::span<const std::byte> query_bytes = pack.Query(layer_index, request_index);
  std::vector<float> query(static_cast<size_t>(pack.num_query_heads()) * pack.head_dim());
  ConvertToF32(pack.dtype(), query_bytes.data(), query.data(), query.size());
  RUBATO_ASSIGN_OR_RETURN(
      KvHeadSelection top,
      ExactTopK(store, request.session_id, pack.first_layer() + layer_index, query,
                static_cast<uint32_t>(spec.top_k), static_cast<uint32_t>(range.sink_end),
                static_cast<uint32_t>(range.recent_begin)));
  for (uint32_t h = 0; h < kv_heads; ++h) {
    std::vector<int32_t>& positions = selection[h];
    for (int j = 0; j < range.sink_end; ++j) positions.push_back(j);
    positions.insert(positions.end(), top[h].begin(), top[h].end());
  }
  return selection;
}

}  // namespace rubato
