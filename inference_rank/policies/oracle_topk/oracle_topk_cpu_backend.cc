// Oracle top-k on the CPU model (see oracle_topk_cpu_backend.h).
#include "inference_rank/policies/oracle_topk/oracle_topk_cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cpu/compact_gather.h"
#include "kernels/cpu/pooled_top_k.h"

namespace rubato {
namespace {

// One entry's selection of the current layer: its positions and its compact rows.
struct EntrySelection {
  std::vector<std::vector<int>> kept;  // [kv_head] sink then selected, ascending
  std::vector<int> counts;             // [kv_head]
  int capacity = 0;                    // rows per KV head: sink_end + min(top_k, |J|)
  std::vector<float> keys;             // [kv_head][capacity][head_dim], f32
  std::vector<float> values;           // [kv_head][capacity][head_dim], f32
};

class OracleTopKCpuBackend final : public CpuAttentionBackend {
 public:
  OracleTopKCpuBackend(const ModelConfig& model, const OracleTopKConfig& config)
      : model_(model), config_(config) {}

  Status BeforeAttention(const CpuLayerContext& context) override {
    if (selections_.size() < context.entries.size()) selections_.resize(context.entries.size());
    for (size_t e = 0; e < context.entries.size(); ++e) {
      const CpuEntryRows& entry = context.entries[e];
      if (entry.attention == nullptr) continue;
      RUBATO_RETURN_IF_ERROR(Select(context, entry, selections_[e])
                                 .WithContext("oracle_topk, batch entry " + std::to_string(e)));
    }
    return Status::Ok();
  }

  Result<CompactSegment> Compact(const CpuLayerContext& /*context*/, int entry) override {
    EntrySelection& selection = selections_[static_cast<size_t>(entry)];
    CompactSegment segment;
    segment.view = CompactKvView{selection.keys.data(), selection.values.data(),
                                 model_.num_kv_heads, selection.capacity, model_.head_dim};
    segment.counts = selection.counts.data();
    return segment;
  }

  const std::vector<std::vector<int>>& Kept(int entry) const {
    return selections_.at(static_cast<size_t>(entry)).kept;
  }

 private:
  Status Select(const CpuLayerContext& context, const CpuEntryRows& entry,
                EntrySelection& selection);

  ModelConfig model_;
  OracleTopKConfig config_;
  std::vector<EntrySelection> selections_;  // [entries], buffers reused across steps
  std::vector<float> logits_;               // [group][|J|], f32: one KV head's
  std::vector<int> selected_;
};

Status OracleTopKCpuBackend::Select(const CpuLayerContext& context, const CpuEntryRows& entry,
                                    EntrySelection& selection) {
  const int kv_heads = model_.num_kv_heads;
  const int group = model_.num_heads / kv_heads;
  const int head_dim = model_.head_dim;
  const int length = entry.start_position + 1;
  const OracleCandidates candidates = OracleCandidatesFor(config_, length);
  if (entry.attention->action.recent_begin != candidates.recent_begin) {
    return InvalidArgumentError("planned recent segment starts at " +
                                std::to_string(entry.attention->action.recent_begin) +
                                ", the config's at " + std::to_string(candidates.recent_begin));
  }
  const int count = candidates.count();
  const PagedKvView kv = context.cache->LayerView(context.layer, *entry.sequence);
  const float* query = context.q + static_cast<size_t>(entry.first_token) * model_.q_dim();
  selection.kept.resize(static_cast<size_t>(kv_heads));
  for (int h = 0; h < kv_heads; ++h) {
    RUBATO_RETURN_IF_ERROR(PooledTopKOfQuery(query + static_cast<size_t>(h * group) * head_dim,
                                             group, kv, h, candidates.sink_end, count,
                                             config_.top_k, logits_, selected_));
    std::vector<int>& kept = selection.kept[static_cast<size_t>(h)];
    kept.clear();
    for (int position = 0; position < candidates.sink_end; ++position) kept.push_back(position);
    kept.insert(kept.end(), selected_.begin(), selected_.end());
  }
  selection.capacity = candidates.sink_end + std::min(config_.top_k, count);
  const size_t floats = static_cast<size_t>(kv_heads) * selection.capacity * head_dim;
  selection.keys.resize(floats);
  selection.values.resize(floats);
  selection.counts.resize(static_cast<size_t>(kv_heads));
  const CompactKvView compact{selection.keys.data(), selection.values.data(), kv_heads,
                              selection.capacity, head_dim};
  return GatherCompactKv(kv, length, selection.kept, compact, selection.counts);
}

}  // namespace

Result<std::unique_ptr<AttentionBackend>> MakeOracleTopKCpuBackend(const ModelConfig& model,
                                                                   const OracleTopKConfig& config) {
  return std::unique_ptr<AttentionBackend>(new OracleTopKCpuBackend(model, config));
}

const std::vector<std::vector<int>>& OracleTopKKeptForTest(const AttentionBackend& backend,
                                                           int entry) {
  return dynamic_cast<const OracleTopKCpuBackend&>(backend).Kept(entry);
}

}  // namespace rubato
