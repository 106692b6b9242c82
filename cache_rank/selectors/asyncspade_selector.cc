// AsyncSpadeCacheSelector (asyncspade_selector.h): query windows, prediction, selection for the
// next step, and the counters that say how good the prediction was.
#include "cache_rank/selectors/asyncspade_selector.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cache_rank/exact_top_k.h"
#include "cache_rank/prediction_measure.h"
#include "cache_rank/query_predictor.h"
#include "common/dtype.h"

namespace rubato {
namespace {

constexpr int kMaxQueryWindow = 64;  // a k x k solve per window size, head and step

// One layer of a session: its query windows and the prediction made at the last step for the
// token after it (what the next step's query is compared with).
struct LayerPrediction {
  explicit LayerPrediction(const SessionShape& shape, int window)
      : window(static_cast<int>(shape.num_query_heads), window, static_cast<int>(shape.head_dim)),
        predicted(size_t{shape.num_query_heads} * shape.head_dim) {}

  QueryWindow window;            // [query heads] x the last W + 1 queries
  std::vector<float> predicted;  // [query heads][head_dim]: the last prediction
  int predicted_length = -1;     // the attention length of the token it was made for
  int sink_end = 0;              // the range its selection was made over
  int recent_begin = 0;
  KvHeadSelection selected;  // per KV head the top_k part of that selection (sink excluded)
  uint64_t steps = 0;        // one-token steps seen (the overlap's cadence)
};

class AsyncSpadeState final : public CacheSelectorState {
 public:
  AsyncSpadeState(const SessionShape& shape, int window) {
    layers.reserve(shape.num_layers);
    for (uint32_t l = 0; l < shape.num_layers; ++l) layers.emplace_back(shape, window);
  }
  std::vector<LayerPrediction> layers;  // [layer]
};

}  // namespace

constinit const AsyncSpadeCacheSelector kAsyncSpadeCacheSelector;

Status AsyncSpadeCacheSelector::Validate(const CacheSelectorSpec& spec) const {
  const auto bad = [&](const char* field, const std::string& value, const char* want) {
    return InvalidArgumentError("cache rank: selector " + std::string(name()) + ": " + field +
                                " must be " + want + ", got " + value);
  };
  if (spec.top_k < 1) return bad("top_k", std::to_string(spec.top_k), ">= 1");
  if (spec.sink_tokens < 0) return bad("sink_tokens", std::to_string(spec.sink_tokens), ">= 0");
  if (spec.recent_tokens < 1) {
    return bad("recent_tokens", std::to_string(spec.recent_tokens), ">= 1");
  }
  if (spec.query_window < 1 || spec.query_window > kMaxQueryWindow) {
    return bad("query_window", std::to_string(spec.query_window), "in [1, 64]");
  }
  if (!std::isfinite(spec.ridge_lambda) || spec.ridge_lambda <= 0) {
    return bad("ridge_lambda", std::to_string(spec.ridge_lambda), "finite and > 0");
  }
  if (spec.dense_steps < 0) return bad("dense_steps", std::to_string(spec.dense_steps), ">= 0");
  if (spec.overlap_every < 0) {
    return bad("overlap_every", std::to_string(spec.overlap_every), ">= 0");
  }
  return Status::Ok();
}

ReplyRange AsyncSpadeCacheSelector::ReplyRangeFor(const CacheSelectorSpec& spec, int first_position,
                                                  int new_tokens) const {
  const int next_length = first_position + new_tokens + 1;  // the next token's attention
  const int recent_begin = std::max(0, next_length - spec.recent_tokens);
  const int sink_end = std::min(spec.sink_tokens, recent_begin);
  return {sink_end, recent_begin, sink_end + std::min(spec.top_k, recent_begin - sink_end)};
}

std::unique_ptr<CacheSelectorState> AsyncSpadeCacheSelector::NewState(
    const CacheSelectorSpec& spec, const SessionShape& shape) const {
  return std::make_unique<AsyncSpadeState>(shape, spec.query_window);
}

Result<KvHeadSelection> AsyncSpadeCacheSelector::Select(
    const CacheSelectorSpec& spec, const KvStore& store, const LayerPackView& pack,
    uint32_t layer_index, uint32_t request_index, CacheSelectorState* state) const {
  auto* sessions = dynamic_cast<AsyncSpadeState*>(state);
  const uint32_t layer = pack.first_layer() + layer_index;
  if (sessions == nullptr || layer >= sessions->layers.size()) {
    return FailedPreconditionError("cache rank: selector asyncspade: layer " +
                                   std::to_string(layer) + " has no query window state");
  }
  LayerPrediction& prediction = sessions->layers[layer];
  const LayerPackRequest& request = pack.requests()[request_index];
  const int first = static_cast<int>(request.first_position);
  const int tokens = static_cast<int>(request.new_tokens);
  const uint32_t heads = pack.num_query_heads();
  const uint32_t dim = pack.head_dim();
  std::vector<float> query(size_t{heads} * dim);
  ConvertToF32(pack.dtype(), pack.Query(layer_index, request_index).data(), query.data(),
               query.size());
  for (size_t i = 0; i < query.size(); ++i) {
    if (!std::isfinite(query[i])) {
      return InvalidArgumentError(
          "cache rank: selector asyncspade: session " + std::to_string(request.session_id) +
          " layer " + std::to_string(layer) + ": query[" + std::to_string(i) + "] is not finite");
    }
  }

  // The query that came against the prediction made for it at the last step.
  if (tokens == 1 && prediction.predicted_length == first + 1) {
    ++prediction.steps;
    for (uint32_t h = 0; h < heads; ++h) {
      sessions->counters.cosine_sum +=
          QueryCosine(&prediction.predicted[size_t{h} * dim], &query[size_t{h} * dim], dim);
      ++sessions->counters.cosine_count;
    }
    const int candidates = prediction.recent_begin - prediction.sink_end;
    if (spec.overlap_every > 0 && prediction.steps % spec.overlap_every == 0 &&
        candidates > spec.top_k) {
      RUBATO_ASSIGN_OR_RETURN(
          const KvHeadSelection exact,
          ExactTopK(store, request.session_id, layer, query, static_cast<uint32_t>(spec.top_k),
                    static_cast<uint32_t>(prediction.sink_end),
                    static_cast<uint32_t>(prediction.recent_begin)));
      for (size_t g = 0; g < exact.size(); ++g) {
        sessions->counters.overlap_hits += SelectionHits(exact[g], prediction.selected[g]);
        sessions->counters.overlap_total += exact[g].size();
      }
    }
  }

  // A prompt chunk's queries are not consecutive steps: the windows start again from its last.
  if (tokens > 1)
    prediction.window =
        QueryWindow(static_cast<int>(heads), spec.query_window, static_cast<int>(dim));
  prediction.window.Push(query);
  prediction.window.Predict(spec.ridge_lambda, prediction.predicted);

  const ReplyRange range = ReplyRangeFor(spec, first, tokens);
  prediction.predicted_length = first + tokens + 1;
  prediction.sink_end = range.sink_end;
  prediction.recent_begin = range.recent_begin;
  KvHeadSelection selection(pack.num_kv_heads());
  prediction.selected.assign(pack.num_kv_heads(), {});
  if (range.slots == 0) return selection;
  RUBATO_ASSIGN_OR_RETURN(
      KvHeadSelection top,
      ExactTopK(store, request.session_id, layer, prediction.predicted,
                static_cast<uint32_t>(spec.top_k), static_cast<uint32_t>(range.sink_end),
                static_cast<uint32_t>(range.recent_begin)));
  for (uint32_t g = 0; g < pack.num_kv_heads(); ++g) {
    std::vector<int32_t>& positions = selection[g];
    for (int j = 0; j < range.sink_end; ++j) positions.push_back(j);
    positions.insert(positions.end(), top[g].begin(), top[g].end());
  }
  prediction.selected = std::move(top);
  return selection;
}

}  // namespace rubato
