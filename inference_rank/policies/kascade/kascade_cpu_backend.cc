// Kascade on the CPU model (see kascade_cpu_backend.h).
#include "inference_rank/policies/kascade/kascade_cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/pooled_top_k.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/tile_gather_attention.h"

namespace rubato {
namespace {

using Lists = std::vector<std::vector<int>>;  // [tile * kv_heads + kv_head] ascending positions

class KascadeCpuBackend final : public CpuAttentionBackend {
 public:
  KascadeCpuBackend(const ModelConfig& model, const KascadePolicy& policy)
      : model_(model),
        config_(policy.config()),
        head_map_(policy.calibration().head_map),
        policy_(policy),
        inv_freq_(RopeInverseFrequencies(model.head_dim, model.rope_theta, model.rope_scaling)) {}

  Status BeforeAttention(const CpuLayerContext& context) override {
    if (entries_.size() < context.entries.size()) entries_.resize(context.entries.size());
    for (size_t e = 0; e < context.entries.size(); ++e) {
      const CpuEntryRows& entry = context.entries[e];
      if (entry.attention == nullptr) continue;
      if (!(entry.attention->ActionFor(context.layer).evidence & kPooledProbs)) continue;
      EntryState& state = entries_[e];
      state.selections.resize(static_cast<size_t>(model_.num_layers));
      Lists& lists = state.selections[static_cast<size_t>(context.layer)];
      const Status status = entry.tokens == 1 ? SelectDecode(context, entry, lists)
                                              : SelectPrefill(context, entry, lists);
      RUBATO_RETURN_IF_ERROR(status.WithContext("kascade, layer " + std::to_string(context.layer) +
                                                ", batch entry " + std::to_string(e)));
    }
    return Status::Ok();
  }

  Result<CompactSegment> Compact(const CpuLayerContext& /*layer*/, int /*entry*/) override {
    return InternalError("kascade plans no two-segment attention");
  }

  Result<GatherPositions> Positions(const CpuLayerContext& context, int entry) override {
    EntryState& state = entries_.at(static_cast<size_t>(entry));
    const CpuEntryRows& rows = context.entries[static_cast<size_t>(entry)];
    const int layer = context.layer;
    const int anchor = rows.attention->ActionFor(layer).source_layer;
    const int kv_heads = model_.num_kv_heads;
    const int tiles = rows.tokens == 1
                          ? 1
                          : TileGatherTiles(rows.start_position, rows.tokens, config_.prefill_tile);
    if (rows.tokens == 1 && anchor != layer && config_.fidelity_guard > 0.0) {
      RUBATO_ASSIGN_OR_RETURN(bool own, GuardFires(context, rows));
      if (own) return OwnSelection(context, rows, state);
    }
    const Lists* selected = static_cast<size_t>(anchor) < state.selections.size()
                                ? &state.selections[static_cast<size_t>(anchor)]
                                : nullptr;
    if (selected == nullptr || selected->size() != static_cast<size_t>(tiles) * kv_heads) {
      return InternalError("kascade: layer " + std::to_string(layer) + " reads anchor " +
                           std::to_string(anchor) + ", which selected nothing for this entry");
    }
    state.lists.resize(static_cast<size_t>(tiles) * kv_heads);
    state.counts.resize(state.lists.size());
    for (int t = 0; t < tiles; ++t) {
      for (int h = 0; h < kv_heads; ++h) {
        const int from = head_map_[static_cast<size_t>(layer)][static_cast<size_t>(h)];
        const std::vector<int>& list = (*selected)[static_cast<size_t>(t) * kv_heads + from];
        state.lists[static_cast<size_t>(t) * kv_heads + h] = list.data();
        state.counts[static_cast<size_t>(t) * kv_heads + h] = static_cast<int>(list.size());
      }
    }
    return GatherPositions{state.lists.data(), state.counts.data(), tiles,
                           rows.tokens == 1 ? 0 : config_.prefill_tile};
  }

  // [tile * kv_heads + kv_head] of the last forward.
  const Lists& Selection(int entry, int layer) const {
    return entries_.at(static_cast<size_t>(entry)).selections.at(static_cast<size_t>(layer));
  }

 private:
  struct EntryState {
    std::vector<Lists> selections;  // [layer]; anchors only
    Lists own;                      // [kv_head]: a reuse layer's own top-k (the guard's)
    std::vector<const int*> lists;  // Positions' answer
    std::vector<int> counts;
  };

  // The guard on a reuse layer's decode token: whether its query drifted from its query at its
  // own last top-k (none yet: fires).
  Result<bool> GuardFires(const CpuLayerContext& context, const CpuEntryRows& rows) {
    if (rows.attention->state == nullptr) {
      return InternalError("kascade: a plan with the fidelity guard on has no guard state");
    }
    QueryDriftGuard& guard = static_cast<KascadeGuardState*>(rows.attention->state)->guard;
    const float* query = context.q + static_cast<size_t>(rows.first_token) * model_.q_dim();
    const bool fired = QueryDriftGuard::Fires(
        config_.fidelity_guard,
        guard.LayerCosine(context.layer, query, rows.start_position, GuardShape()));
    policy_.CountGuard(fired);
    if (fired) guard.Remember(context.layer, query, rows.start_position, GuardShape());
    return fired;
  }
  // The reuse layer's own top-k (the anchors' rule on its own query, no head map).
  Result<GatherPositions> OwnSelection(const CpuLayerContext& context, const CpuEntryRows& rows,
                                       EntryState& state) {
    RUBATO_RETURN_IF_ERROR(SelectDecode(context, rows, state.own));
    const int kv_heads = model_.num_kv_heads;
    state.lists.resize(static_cast<size_t>(kv_heads));
    state.counts.resize(static_cast<size_t>(kv_heads));
    for (int h = 0; h < kv_heads; ++h) {
      state.lists[static_cast<size_t>(h)] = state.own[static_cast<size_t>(h)].data();
      state.counts[static_cast<size_t>(h)] =
          static_cast<int>(state.own[static_cast<size_t>(h)].size());
    }
    return GatherPositions{state.lists.data(), state.counts.data(), 1, 0};
  }

  Status SelectDecode(const CpuLayerContext& context, const CpuEntryRows& entry, Lists& lists);
  Status SelectPrefill(const CpuLayerContext& context, const CpuEntryRows& entry, Lists& lists);

  ModelConfig model_;
  KascadeConfig config_;
  std::vector<std::vector<int>> head_map_;  // [layer][kv_head] -> the anchor's KV head
  const KascadePolicy& policy_;             // outlives its backend (the engine holds both)
  std::vector<float> inv_freq_;             // [head_dim / 2] RoPE's, for the guard
  QueryDriftGuard::Shape GuardShape() const {
    return {model_.num_heads, model_.head_dim, inv_freq_.data()};
  }
  std::vector<EntryState> entries_;  // [batch entries], buffers reused across steps
  std::vector<float> logits_;        // [group][L]: one KV head's
  std::vector<double> pooled_;       // [tile start]: one tile's pooled probabilities
};

// One decode token: per KV head the top k of its GQA group's mean softmax over [0, L).
Status KascadeCpuBackend::SelectDecode(const CpuLayerContext& context, const CpuEntryRows& entry,
                                       Lists& lists) {
  const int kv_heads = model_.num_kv_heads;
  const int group = model_.num_heads / kv_heads;
  const int head_dim = model_.head_dim;
  const int length = entry.start_position + 1;
  const int k = KascadeTopK(config_, length);
  const PagedKvView kv = context.cache->LayerView(context.layer, *entry.sequence);
  const float* query = context.q + static_cast<size_t>(entry.first_token) * model_.q_dim();
  lists.resize(static_cast<size_t>(kv_heads));
  for (int h = 0; h < kv_heads; ++h) {
    RUBATO_RETURN_IF_ERROR(PooledTopKOfQuery(query + static_cast<size_t>(h * group) * head_dim,
                                             group, kv, h, 0, length, k, logits_,
                                             lists[static_cast<size_t>(h)]));
  }
  return Status::Ok();
}

// A prefill chunk: per tile [b, b + T) it meets and KV head, the min(b, KascadeTopK(b + T))
// positions before b of highest post-softmax probability (each query's softmax over all it
// sees), averaged over the tile's queries in this chunk and the GQA group; ascending, ties low.
Status KascadeCpuBackend::SelectPrefill(const CpuLayerContext& context, const CpuEntryRows& entry,
                                        Lists& lists) {
  const int kv_heads = model_.num_kv_heads;
  const int group = model_.num_heads / kv_heads;
  const int head_dim = model_.head_dim;
  const int tile = config_.prefill_tile;
  const int start = entry.start_position;
  const int end = start + entry.tokens;
  const int tiles = TileGatherTiles(start, entry.tokens, tile);
  const PagedKvView kv = context.cache->LayerView(context.layer, *entry.sequence);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  lists.resize(static_cast<size_t>(tiles) * kv_heads);
  std::vector<double> row;
  std::vector<int> order;
  for (int t = 0; t < tiles; ++t) {
    const int begin = (start / tile + t) * tile;
    const int k = std::min(begin, KascadeTopK(config_, begin + tile));
    const int first = std::max(begin, start);
    const int last = std::min(begin + tile, end);  // queries [first, last) of this chunk
    for (int h = 0; h < kv_heads; ++h) {
      std::vector<int>& list = lists[static_cast<size_t>(t) * kv_heads + h];
      list.resize(static_cast<size_t>(begin));
      std::iota(list.begin(), list.end(), 0);
      if (k >= begin) continue;  // every earlier position kept
      pooled_.assign(static_cast<size_t>(begin), 0.0);
      const double weight = 1.0 / (static_cast<double>(last - first) * group);
      for (int p = first; p < last; ++p) {
        const float* q_row =
            context.q + static_cast<size_t>(entry.first_token + p - start) * model_.q_dim();
        for (int g = 0; g < group; ++g) {
          const float* q = q_row + static_cast<size_t>(h * group + g) * head_dim;
          row.resize(static_cast<size_t>(p) + 1);
          double max = -INFINITY;
          for (int j = 0; j <= p; ++j) {
            row[j] = Dot(q, kv.keys + kv.Offset(j, h), head_dim) * scale;
            max = std::max(max, row[j]);
          }
          double sum = 0.0;
          for (int j = 0; j <= p; ++j) sum += (row[j] = std::exp(row[j] - max));
          for (int j = 0; j < begin; ++j) pooled_[j] += row[j] / sum * weight;
        }
      }
      order.resize(static_cast<size_t>(begin));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
        return pooled_[a] > pooled_[b] || (pooled_[a] == pooled_[b] && a < b);
      });
      list.assign(order.begin(), order.begin() + k);
      std::sort(list.begin(), list.end());
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<AttentionBackend>> MakeKascadeCpuBackend(const ModelConfig& model,
                                                                const KascadePolicy& policy) {
  return std::unique_ptr<AttentionBackend>(new KascadeCpuBackend(model, policy));
}

const std::vector<std::vector<int>>& KascadeSelectionForTest(const AttentionBackend& backend,
                                                             int entry, int layer) {
  return dynamic_cast<const KascadeCpuBackend&>(backend).Selection(entry, layer);
}

}  // namespace rubato
