// CpuModel's SFI paths (sfi_state.h, DESIGN §4.2). Fast entries attend their compact buffer
// and the recent segment through the two-segment op; slow entries, after each layer's dense
// attention, compute the Selector's logits over J from their last W queries, select, and gather
// the layer's compact buffer. The CPU reference runs the Selector in line, layer by layer; the
// CUDA backend overlaps it with the next layer.
#include <cmath>
#include <string>

#include "inference_rank/model/cpu_model.h"
#include "kernels/cpu/compact_gather.h"
#include "kernels/cpu/dot.h"
#include "kernels/cpu/key_norms.h"
#include "kernels/cpu/sfi_selector.h"
#include "kernels/cpu/two_segment_attention.h"

namespace rubato {
namespace {

// Rows per KV head of a compact buffer: the sink positions then up to `budget` selected ones.
int CompactCapacity(const SfiPolicyConfig& config) {
  return config.sink_tokens + config.selector.budget;
}

template <typename T>
void GrowTo(std::vector<T>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
}

}  // namespace

int CpuModel::SfiFastScratchFloats(const EntryPlan& p) const {
  TwoSegmentAttentionArgs shape_only;  // the scratch size depends on these sizes only
  shape_only.compact.capacity = CompactCapacity(*p.sfi->config);
  shape_only.recent_begin = p.sfi->state->anchor;
  shape_only.recent_end = p.start_position + 1;
  return TwoSegmentAttentionScratchSize(shape_only);
}

Status CpuModel::SfiFastArgs(int layer, PagedKvCache& cache, const EntryPlan& p,
                             TwoSegmentAttentionArgs& args) {
  const SfiLayerState& state = p.sfi->state->layers[static_cast<size_t>(layer)];
  const int capacity = CompactCapacity(*p.sfi->config);
  const size_t compact_floats =
      static_cast<size_t>(config_.num_kv_heads) * capacity * config_.head_dim;
  if (state.compact_keys.size() != compact_floats ||
      state.compact_values.size() != compact_floats) {
    return InvalidArgumentError("forward: SFI compact buffer of layer " + std::to_string(layer) +
                                " was made for another budget or model");
  }
  const size_t offset = static_cast<size_t>(p.first_token) * config_.q_dim();
  args.query = q_.data() + offset;
  args.output = attention_.data() + offset;
  args.num_heads = config_.num_heads;
  // The op reads the compact buffer only; the view's pointers are non-const for the gather.
  args.compact = CompactKvView{const_cast<float*>(state.compact_keys.data()),
                               const_cast<float*>(state.compact_values.data()),
                               config_.num_kv_heads, capacity, config_.head_dim};
  args.compact_counts = state.counts.data();
  args.kv = cache.LayerView(layer, *p.sequence);
  args.recent_begin = p.sfi->state->anchor;
  args.recent_end = p.start_position + 1;
  return ValidateTwoSegmentAttention(args);
}

Status CpuModel::SfiRefreshLayer(int layer, PagedKvCache& cache, const EntryPlan& p) {
  const SfiPolicyConfig& config = *p.sfi->config;
  SfiSequenceState& state = *p.sfi->state;
  const int heads = config_.num_heads;
  const int kv_heads = config_.num_kv_heads;
  const int group = heads / kv_heads;
  const int head_dim = config_.head_dim;
  const int q_dim = config_.q_dim();
  const int length = p.start_position + p.tokens;
  const int sink_end = SfiSinkEnd(config, length);
  const int j_count = SfiAnchor(config, length) - sink_end;  // J = [sink_end, anchor)
  const int window = p.sfi->window_queries;                   // the entry's last W queries
  const bool want_norms = config.selector.gamma > 0.0;
  const PagedKvView kv = cache.LayerView(layer, *p.sequence);
  // The attention op's scale: 1/sqrt(head_dim) rounded once from double.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));

  // logits: [window][heads][j_count]; key norms: [kv_heads][j_count].
  GrowTo(sfi_logits_, static_cast<size_t>(window) * heads * j_count);
  if (want_norms) GrowTo(sfi_key_norms_, static_cast<size_t>(kv_heads) * j_count);
  const float* first_query =
      q_.data() + static_cast<size_t>(p.first_token + p.tokens - window) * q_dim;
  if (want_norms) {
    RUBATO_RETURN_IF_ERROR(KeyNorms(kv, sink_end, j_count, sfi_key_norms_.data(), j_count));
  }
  thread_pool_->ParallelFor(kv_heads, [&](int kv_head, int /*worker*/) {
    for (int j = 0; j < j_count; ++j) {
      const float* key = kv.keys + kv.Offset(sink_end + j, kv_head);
      for (int w = 0; w < window; ++w) {
        for (int g = 0; g < group; ++g) {
          const int head = kv_head * group + g;
          const float* query = first_query + static_cast<size_t>(w) * q_dim +
                               static_cast<size_t>(head) * head_dim;
          // The attention op's score, rounded alike (dot.h).
          sfi_logits_[(static_cast<size_t>(w) * heads + head) * j_count + j] =
              Dot(query, key, head_dim) * scale;
        }
      }
    }
  });

  SfiSelectorInput input;
  input.num_kv_heads = kv_heads;
  input.group = group;
  input.window = window;
  input.j_begin = sink_end;
  input.j_count = j_count;
  input.logits = sfi_logits_.data();
  input.key_norms = want_norms ? sfi_key_norms_.data() : nullptr;
  RUBATO_RETURN_IF_ERROR(SelectSfi(config.selector, input, sfi_selected_));

  if (state.layers.size() != static_cast<size_t>(config_.num_layers)) {
    state.layers.assign(static_cast<size_t>(config_.num_layers), SfiLayerState());
  }
  SfiLayerState& layer_state = state.layers[static_cast<size_t>(layer)];
  const int capacity = CompactCapacity(config);
  layer_state.kept.resize(static_cast<size_t>(kv_heads));
  for (int h = 0; h < kv_heads; ++h) {
    std::vector<int>& kept = layer_state.kept[static_cast<size_t>(h)];
    kept.clear();
    for (int position = 0; position < sink_end; ++position) kept.push_back(position);
    const std::vector<int>& selected = sfi_selected_[static_cast<size_t>(h)];
    kept.insert(kept.end(), selected.begin(), selected.end());
  }
  const size_t compact_floats = static_cast<size_t>(kv_heads) * capacity * head_dim;
  layer_state.compact_keys.resize(compact_floats);
  layer_state.compact_values.resize(compact_floats);
  layer_state.counts.resize(static_cast<size_t>(kv_heads));
  const CompactKvView compact{layer_state.compact_keys.data(), layer_state.compact_values.data(),
                              kv_heads, capacity, head_dim};
  return GatherCompactKv(kv, length, layer_state.kept, compact, layer_state.counts);
}

}  // namespace rubato
