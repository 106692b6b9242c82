// Kascade on the CPU model (see kascade_cpu_backend.h).
#include "inference_rank/policies/kascade/kascade_cpu_backend.h"

#include <cmath>
#include <string>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/pooled_top_k.h"

namespace rubato {
namespace {

class KascadeCpuBackend final : public CpuAttentionBackend {
 public:
  KascadeCpuBackend(const ModelConfig& model, const KascadePolicy& policy)
      : model_(model), config_(policy.config()), head_map_(policy.calibration().head_map) {}

  Status BeforeAttention(const CpuLayerContext& context) override {
    if (entries_.size() < context.entries.size()) entries_.resize(context.entries.size());
    for (size_t e = 0; e < context.entries.size(); ++e) {
      const CpuEntryRows& entry = context.entries[e];
      if (entry.attention == nullptr) continue;
      if (!(entry.attention->ActionFor(context.layer).evidence & kPooledProbs)) continue;
      RUBATO_RETURN_IF_ERROR(Select(context, entry, entries_[e])
                                 .WithContext("kascade, layer " + std::to_string(context.layer) +
                                              ", batch entry " + std::to_string(e)));
    }
    return Status::Ok();
  }

  Result<CompactSegment> Compact(const CpuLayerContext& /*layer*/, int /*entry*/) override {
    return InternalError("kascade plans no two-segment attention");
  }

  Result<GatherPositions> Positions(const CpuLayerContext& context, int entry) override {
    EntryState& state = entries_.at(static_cast<size_t>(entry));
    const int layer = context.layer;
    const int anchor =
        context.entries[static_cast<size_t>(entry)].attention->ActionFor(layer).source_layer;
    const auto& selected = state.selections.at(static_cast<size_t>(anchor));
    if (selected.empty()) {
      return InternalError("kascade: layer " + std::to_string(layer) + " reads anchor " +
                           std::to_string(anchor) + ", which selected nothing this step");
    }
    const int kv_heads = model_.num_kv_heads;
    state.heads.resize(static_cast<size_t>(kv_heads));
    state.counts.resize(static_cast<size_t>(kv_heads));
    for (int h = 0; h < kv_heads; ++h) {
      const int from = head_map_[static_cast<size_t>(layer)][static_cast<size_t>(h)];
      const std::vector<int>& list = selected[static_cast<size_t>(from)];
      state.heads[static_cast<size_t>(h)] = list.data();
      state.counts[static_cast<size_t>(h)] = static_cast<int>(list.size());
    }
    return GatherPositions{state.heads.data(), state.counts.data()};
  }

  const std::vector<std::vector<int>>& Selection(int entry, int layer) const {
    return entries_.at(static_cast<size_t>(entry)).selections.at(static_cast<size_t>(layer));
  }

 private:
  struct EntryState {
    std::vector<std::vector<std::vector<int>>> selections;  // [layer][kv_head], anchors only
    std::vector<const int*> heads;                          // Positions' answer
    std::vector<int> counts;
  };

  Status Select(const CpuLayerContext& context, const CpuEntryRows& entry, EntryState& state);

  ModelConfig model_;
  KascadeConfig config_;
  std::vector<std::vector<int>> head_map_;  // [layer][kv_head] -> the anchor's KV head
  std::vector<EntryState> entries_;         // [batch entries], buffers reused across steps
  std::vector<float> logits_;               // [group][L]: one KV head's
};

Status KascadeCpuBackend::Select(const CpuLayerContext& context, const CpuEntryRows& entry,
                                 EntryState& state) {
  if (entry.tokens != 1) {
    return InvalidArgumentError("selections are made for one decode token, got " +
                                std::to_string(entry.tokens));
  }
  const int kv_heads = model_.num_kv_heads;
  const int group = model_.num_heads / kv_heads;
  const int head_dim = model_.head_dim;
  const int length = entry.start_position + 1;
  const int k = KascadeTopK(config_, length);
  const PagedKvView kv = context.cache->LayerView(context.layer, *entry.sequence);
  // The attention op's scale and score rounding (dot.h).
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const float* query = context.q + static_cast<size_t>(entry.first_token) * model_.q_dim();
  state.selections.resize(static_cast<size_t>(model_.num_layers));
  auto& selected = state.selections[static_cast<size_t>(context.layer)];
  selected.resize(static_cast<size_t>(kv_heads));
  logits_.resize(static_cast<size_t>(group) * length);
  for (int h = 0; h < kv_heads; ++h) {
    for (int g = 0; g < group; ++g) {
      const float* q = query + static_cast<size_t>(h * group + g) * head_dim;
      for (int j = 0; j < length; ++j) {
        logits_[static_cast<size_t>(g) * length + j] =
            Dot(q, kv.keys + kv.Offset(j, h), head_dim) * scale;
      }
    }
    PooledTopKInput input;
    input.scores = logits_.data();
    input.stride = length;
    input.group = group;
    input.count = length;
    input.begin = 0;
    input.units = ScoreUnits::kNatural;
    RUBATO_RETURN_IF_ERROR(PooledTopK(input, k, selected[static_cast<size_t>(h)]));
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
