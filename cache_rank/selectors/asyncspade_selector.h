// The `asyncspade` cache selector (AsyncSpade §4, App. C; docs/asyncspade.md): one step ahead.
// The reply to a step's pack serves the request's next decode token: per (session, layer, query
// head) the selector keeps the last W + 1 queries (query_predictor.h), predicts the next query by
// the assembled softmax-normalised ridge regression, scores every stored key of the layer with
// the prediction (GQA-pooled, exact_top_k.h) and replies the sink and the top_k positions of
// [sink_end, recent_begin) where recent_begin = max(0, L + 1 - recent_tokens) is the next
// token's recent segment (L: positions stored after this step). A prompt chunk restarts the
// windows from its last query. It also measures itself: the cosine of each prediction against
// the query that came, and (every overlap_every steps) the overlap of the predicted selection
// with that query's exact top_k.
#pragma once

#include "cache_rank/cache_selector.h"

namespace rubato {

class AsyncSpadeCacheSelector final : public CacheSelector {
 public:
  constexpr AsyncSpadeCacheSelector()
      : CacheSelector("asyncspade", {.needs_query = true, .serves_same_step = false}) {}

  // top_k >= 1, sink_tokens >= 0, recent_tokens >= 1, query_window in [1, 64], ridge_lambda
  // finite and > 0, dense_steps >= 0, overlap_every >= 0.
  Status Validate(const CacheSelectorSpec& spec) const override;
  // The ranges of the token after the entry (position first_position + new_tokens).
  ReplyRange ReplyRangeFor(const CacheSelectorSpec& spec, int first_position,
                           int new_tokens) const override;
  std::unique_ptr<CacheSelectorState> NewState(const CacheSelectorSpec& spec,
                                               const SessionShape& shape) const override;
  // Needs `state` (NewState's).
  Result<KvHeadSelection> Select(const CacheSelectorSpec& spec, const KvStore& store,
                                 const LayerPackView& pack, uint32_t layer_index,
                                 uint32_t request_index, CacheSelectorState* state) const override;
};

extern const AsyncSpadeCacheSelector kAsyncSpadeCacheSelector;

}  // namespace rubato
