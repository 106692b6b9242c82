// SFI on the CPU model (see sfi_cpu_backend.h).
#include "inference_rank/policies/sfi/sfi_cpu_backend.h"

#include <cmath>
#include <string>
#include <vector>

#include "common/sizes.h"
#include "inference_rank/policies/sfi/kernels/sfi_selector.h"
#include "inference_rank/policies/sfi/sfi_state.h"
#include "kernels/cpu/compact_gather.h"
#include "kernels/cpu/dot.h"
#include "kernels/cpu/key_norms.h"
#include "kernels/cpu/rope.h"

namespace rubato {
namespace {

class SfiCpuBackend final : public CpuAttentionBackend {
 public:
  SfiCpuBackend(const ModelConfig& model, const SfiPolicyConfig& config)
      : model_(model),
        config_(config),
        inv_freq_(RopeInverseFrequencies(model.head_dim, model.rope_theta, model.rope_scaling)) {}

  // A fast step needs a selection of every layer, made for this model's KV heads.
  Status CheckBatch(std::span<const ForwardEntry> batch) override {
    for (size_t e = 0; e < batch.size(); ++e) {
      if (batch[e].attention == nullptr) continue;
      const std::string where = "forward: batch entry " + std::to_string(e);
      if (batch[e].attention->state == nullptr) {
        return InvalidArgumentError(where + ": SFI entry without a state");
      }
      if (SfiStepOf(*batch[e].attention) == SfiStepKind::kSlow) continue;
      const SfiSequenceState& state = SfiStateOf(*batch[e].attention);
      if (!state.has_selection || static_cast<int>(state.layers.size()) != model_.num_layers) {
        return InvalidArgumentError(where + ": SFI fast step before any slow step");
      }
      for (const SfiLayerState& layer : state.layers) {
        if (static_cast<int>(layer.counts.size()) != model_.num_kv_heads) {
          return InvalidArgumentError(where + ": SFI state made for another model");
        }
      }
    }
    return Status::Ok();
  }

  Result<CompactSegment> Compact(const CpuLayerContext& context, int entry) override {
    const EntryAttention& attention = *context.entries[static_cast<size_t>(entry)].attention;
    const SfiLayerState& state = SfiStateOf(attention).layers[static_cast<size_t>(context.layer)];
    const int capacity = SfiCompactCapacity(config_);
    const size_t compact_floats =
        static_cast<size_t>(model_.num_kv_heads) * capacity * model_.head_dim;
    if (state.compact_keys.size() != compact_floats ||
        state.compact_values.size() != compact_floats) {
      return InvalidArgumentError("forward: SFI compact buffer of layer " +
                                  std::to_string(context.layer) +
                                  " was made for another budget or model");
    }
    CompactSegment segment;
    // The op reads the compact buffer only; the view's pointers are non-const for the gather.
    segment.view = CompactKvView{const_cast<float*>(state.compact_keys.data()),
                                 const_cast<float*>(state.compact_values.data()),
                                 model_.num_kv_heads, capacity, model_.head_dim};
    segment.counts = state.counts.data();
    return segment;
  }

  // Every layer of the slow entries now holds the selection from J = [sink_end, anchor); a
  // fast entry whose mean cosine over the layers fell below the guard's threshold is marked
  // for a redo as a slow step (sfi_policy.cc).
  Status FinishForward(std::span<const ForwardEntry> batch) override {
    for (const ForwardEntry& entry : batch) {
      if (entry.attention == nullptr) continue;
      if (SfiStepOf(*entry.attention) == SfiStepKind::kFast) {
        if (config_.fidelity_guard <= 0.0) continue;
        SfiSequenceState& state = SfiStateOf(*entry.attention);
        state.guard_fired = QueryDriftGuard::Fires(config_.fidelity_guard,
                                                   state.guard_cosine_sum / model_.num_layers);
        continue;
      }
      SfiSequenceState& state = SfiStateOf(*entry.attention);
      state.anchor =
          SfiAnchor(config_, entry.start_position + static_cast<int>(entry.tokens.size()));
      state.has_selection = true;
    }
    return Status::Ok();
  }

  // The fidelity guard (policy.fidelity_guard > 0): each layer adds the cosine of a fast
  // entry's query against the last slow step's; FinishForward judges their mean.
  Status BeforeAttention(const CpuLayerContext& context) override {
    if (config_.fidelity_guard <= 0.0) return Status::Ok();
    for (const CpuEntryRows& entry : context.entries) {
      if (entry.attention == nullptr || SfiStepOf(*entry.attention) != SfiStepKind::kFast) continue;
      SfiSequenceState& state = SfiStateOf(*entry.attention);
      if (context.layer == 0) state.guard_cosine_sum = 0.0;
      const float* query = context.q + static_cast<size_t>(entry.first_token) * model_.q_dim();
      state.guard_cosine_sum +=
          state.guard.LayerCosine(context.layer, query, entry.start_position, GuardShape());
    }
    return Status::Ok();
  }

  // The positions of the compact rows (sink then selected, per KV head), for probes.
  Result<const std::vector<std::vector<int>>*> CompactPositions(const CpuLayerContext& context,
                                                                int entry) override {
    const EntryAttention& attention = *context.entries[static_cast<size_t>(entry)].attention;
    return &SfiStateOf(attention).layers[static_cast<size_t>(context.layer)].kept;
  }

  Status AfterAttention(const CpuLayerContext& context) override {
    for (const CpuEntryRows& entry : context.entries) {
      if (entry.attention != nullptr && SfiStepOf(*entry.attention) == SfiStepKind::kSlow) {
        RUBATO_RETURN_IF_ERROR(RefreshLayer(context, entry));
      }
    }
    return Status::Ok();
  }

 private:
  // A slow entry, after this layer's dense attention: the Selector's logits over J from the
  // entry's last W queries, the selection, and the gather into the layer's compact buffer.
  Status RefreshLayer(const CpuLayerContext& context, const CpuEntryRows& entry);

  QueryDriftGuard::Shape GuardShape() const {
    return {model_.num_heads, model_.head_dim, inv_freq_.data()};
  }

  ModelConfig model_;
  SfiPolicyConfig config_;
  std::vector<float> inv_freq_;  // [head_dim / 2] RoPE's, for the guard
  // Slow steps: [window][num_heads][|J|] logits and [num_kv_heads][|J|] key norms, f32.
  std::vector<float> logits_;
  std::vector<float> key_norms_;
  std::vector<std::vector<int>> selected_;  // [num_kv_heads] the Selector's output
};

Status SfiCpuBackend::RefreshLayer(const CpuLayerContext& context, const CpuEntryRows& entry) {
  const int layer = context.layer;
  SfiSequenceState& state = SfiStateOf(*entry.attention);
  const int heads = model_.num_heads;
  const int kv_heads = model_.num_kv_heads;
  const int group = heads / kv_heads;
  const int head_dim = model_.head_dim;
  const int q_dim = model_.q_dim();
  const int length = entry.start_position + entry.tokens;
  const int sink_end = SfiSinkEnd(config_, length);
  const int j_count = SfiAnchor(config_, length) - sink_end;  // J = [sink_end, anchor)
  const int window = entry.attention->window_queries;         // the entry's last W queries
  const bool want_norms = config_.selector.gamma > 0.0;
  const PagedKvView kv = context.cache->LayerView(layer, *entry.sequence);
  // The attention op's scale: 1/sqrt(head_dim) rounded once from double.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));

  // logits: [window][heads][j_count]; key norms: [kv_heads][j_count].
  GrowVector(logits_, static_cast<size_t>(window) * heads * j_count);
  if (want_norms) GrowVector(key_norms_, static_cast<size_t>(kv_heads) * j_count);
  const float* first_query =
      context.q + static_cast<size_t>(entry.first_token + entry.tokens - window) * q_dim;
  if (want_norms) {
    RUBATO_RETURN_IF_ERROR(KeyNorms(kv, sink_end, j_count, key_norms_.data(), j_count));
  }
  context.pool->ParallelFor(kv_heads, [&](int kv_head, int /*worker*/) {
    for (int j = 0; j < j_count; ++j) {
      const float* key = kv.keys + kv.Offset(sink_end + j, kv_head);
      for (int w = 0; w < window; ++w) {
        for (int g = 0; g < group; ++g) {
          const int head = kv_head * group + g;
          const float* query =
              first_query + static_cast<size_t>(w) * q_dim + static_cast<size_t>(head) * head_dim;
          // The attention op's score, rounded alike (dot.h).
          logits_[(static_cast<size_t>(w) * heads + head) * j_count + j] =
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
  input.logits = logits_.data();
  input.key_norms = want_norms ? key_norms_.data() : nullptr;
  RUBATO_RETURN_IF_ERROR(SelectSfi(config_.selector, input, selected_));

  if (state.layers.size() != static_cast<size_t>(model_.num_layers)) {
    state.layers.assign(static_cast<size_t>(model_.num_layers), SfiLayerState());
  }
  SfiLayerState& layer_state = state.layers[static_cast<size_t>(layer)];
  const int capacity = SfiCompactCapacity(config_);
  layer_state.kept.resize(static_cast<size_t>(kv_heads));
  for (int h = 0; h < kv_heads; ++h) {
    std::vector<int>& kept = layer_state.kept[static_cast<size_t>(h)];
    kept.clear();
    for (int position = 0; position < sink_end; ++position) kept.push_back(position);
    const std::vector<int>& selected = selected_[static_cast<size_t>(h)];
    kept.insert(kept.end(), selected.begin(), selected.end());
  }
  const size_t compact_floats = static_cast<size_t>(kv_heads) * capacity * head_dim;
  layer_state.compact_keys.resize(compact_floats);
  layer_state.compact_values.resize(compact_floats);
  layer_state.counts.resize(static_cast<size_t>(kv_heads));
  const CompactKvView compact{layer_state.compact_keys.data(), layer_state.compact_values.data(),
                              kv_heads, capacity, head_dim};
  if (config_.fidelity_guard > 0.0) {  // the query this selection answers (the window's last)
    state.guard.Remember(layer, first_query + static_cast<size_t>(window - 1) * q_dim, length - 1,
                         GuardShape());
  }
  return GatherCompactKv(kv, length, layer_state.kept, compact, layer_state.counts);
}

}  // namespace

Result<std::unique_ptr<AttentionBackend>> MakeSfiCpuBackend(const ModelConfig& model,
                                                            const SfiPolicyConfig& config) {
  RUBATO_RETURN_IF_ERROR(ValidateSfiPolicyConfig(config).WithContext("policy sfi"));
  return std::unique_ptr<AttentionBackend>(new SfiCpuBackend(model, config));
}

}  // namespace rubato
