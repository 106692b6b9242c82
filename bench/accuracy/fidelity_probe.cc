// The probe of rubato_fidelity (see fidelity_probe.h): a policy decorator whose backend forwards
// every call to the policy's own backend and measures, after each layer's attention, the dense
// attention mass of each decode query on the rows that backend had it attend.
#include "bench/accuracy/fidelity_probe.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "inference_rank/model/model.h"
#include "kernels/cpu/dot.h"

namespace rubato {
namespace {

class ProbeBackend final : public CpuAttentionBackend {
 public:
  ProbeBackend(std::unique_ptr<CpuAttentionBackend> inner, const ModelConfig& model,
               ProbeRecorder* recorder)
      : inner_(std::move(inner)), model_(model), recorder_(recorder) {}

  Status CheckBatch(std::span<const ForwardEntry> batch) override {
    return inner_ != nullptr ? inner_->CheckBatch(batch) : Status::Ok();
  }
  Status BeforeAttention(const CpuLayerContext& layer) override {
    attended_.assign(layer.entries.size(), {});
    return inner_ != nullptr ? inner_->BeforeAttention(layer) : Status::Ok();
  }
  Result<CompactSegment> Compact(const CpuLayerContext& layer, int entry) override {
    RUBATO_ASSIGN_OR_RETURN(CompactSegment segment, Inner()->Compact(layer, entry));
    RUBATO_ASSIGN_OR_RETURN(const std::vector<std::vector<int>>* kept,
                            Inner()->CompactPositions(layer, entry));
    const CpuEntryRows& rows = layer.entries[static_cast<size_t>(entry)];
    const int recent_begin = rows.attention->ActionFor(layer.layer).recent_begin;
    std::vector<std::vector<int>>& lists = attended_[static_cast<size_t>(entry)];
    lists.assign(static_cast<size_t>(model_.num_kv_heads), {});
    for (int h = 0; h < model_.num_kv_heads; ++h) {
      const std::vector<int>& head = (*kept)[static_cast<size_t>(h)];
      std::vector<int>& list = lists[static_cast<size_t>(h)];
      list.assign(head.begin(), head.begin() + segment.counts[h]);
      for (int p = recent_begin; p <= rows.start_position; ++p) list.push_back(p);
    }
    return segment;
  }
  Result<const std::vector<std::vector<int>>*> CompactPositions(const CpuLayerContext& layer,
                                                                int entry) override {
    return Inner()->CompactPositions(layer, entry);
  }
  Result<GatherPositions> Positions(const CpuLayerContext& layer, int entry) override {
    RUBATO_ASSIGN_OR_RETURN(GatherPositions positions, Inner()->Positions(layer, entry));
    if (positions.tiles == 1) {
      std::vector<std::vector<int>>& lists = attended_[static_cast<size_t>(entry)];
      lists.assign(static_cast<size_t>(model_.num_kv_heads), {});
      for (int h = 0; h < model_.num_kv_heads; ++h) {
        lists[static_cast<size_t>(h)].assign(positions.lists[h],
                                             positions.lists[h] + positions.counts[h]);
      }
    }
    return positions;
  }
  Status AttendFixedBudget(const CpuLayerContext& layer, int entry) override {
    RUBATO_RETURN_IF_ERROR(Inner()->AttendFixedBudget(layer, entry));
    RUBATO_ASSIGN_OR_RETURN(std::span<const int32_t> slots, Inner()->SlotPositions(layer, entry));
    std::vector<std::vector<int>>& lists = attended_[static_cast<size_t>(entry)];
    lists.assign(static_cast<size_t>(model_.num_kv_heads), {});
    const size_t per_head = slots.size() / static_cast<size_t>(model_.num_kv_heads);
    for (int h = 0; h < model_.num_kv_heads; ++h) {
      for (size_t i = 0; i < per_head; ++i) {
        const int32_t position = slots[static_cast<size_t>(h) * per_head + i];
        if (position >= 0) lists[static_cast<size_t>(h)].push_back(position);
      }
    }
    return Status::Ok();
  }
  Status AfterAttention(const CpuLayerContext& layer) override {
    for (size_t e = 0; e < layer.entries.size(); ++e) {
      const CpuEntryRows& rows = layer.entries[e];
      if (recorder_->teacher == nullptr) {
        if (rows.tokens == 1) Measure(layer, e, 0, nullptr);
        continue;
      }
      for (int t = 0; t < rows.tokens; ++t) {  // the twin: the teacher's positions only
        const auto found = recorder_->teacher->find(rows.start_position + t);
        if (found != recorder_->teacher->end() && !found->second.kept.empty()) {
          Measure(layer, e, t, &found->second.kept);
        }
      }
    }
    return inner_ != nullptr ? inner_->AfterAttention(layer) : Status::Ok();
  }
  Status AfterAttentionBlock(int layer, const float* residual, const float* update,
                             int tokens) override {
    return inner_ != nullptr ? inner_->AfterAttentionBlock(layer, residual, update, tokens)
                             : Status::Ok();
  }
  Status FinishForward(std::span<const ForwardEntry> batch) override {
    return inner_ != nullptr ? inner_->FinishForward(batch) : Status::Ok();
  }

 private:
  CpuAttentionBackend* Inner() {
    // Only plans of the policy reach the calls above, and a policy that plans has a backend.
    return inner_.get();
  }
  // Row `t` of entry `e`; `teacher_kept` set: the twin's row, measured against those positions
  // ([layer * kv_heads + kv_head]) instead of what this backend attended.
  void Measure(const CpuLayerContext& layer, size_t e, int t,
               const std::vector<std::vector<int>>* teacher_kept);

  std::unique_ptr<CpuAttentionBackend> inner_;  // null: the policy is dense
  ModelConfig model_;
  ProbeRecorder* recorder_;
  std::vector<std::vector<std::vector<int>>> attended_;  // [entry][kv_head] positions, this layer
  std::vector<double> pooled_;                           // [position] one KV head's
  std::vector<double> logits_;
  std::vector<char> mask_;
};

void ProbeBackend::Measure(const CpuLayerContext& layer, size_t e, int t,
                           const std::vector<std::vector<int>>* teacher_kept) {
  const CpuEntryRows& rows = layer.entries[e];
  const int position = rows.start_position + t;
  const int length = position + 1;
  const int kv_heads = model_.num_kv_heads;
  const int layers = model_.num_layers;
  const int spans = static_cast<int>(recorder_->spans.size());
  ProbeStep& step = recorder_->steps[position];
  if (layer.layer == 0) {  // a redone step starts again
    step = ProbeStep();
    step.position = position;
    step.dense = true;
    step.share.assign(static_cast<size_t>(layers) * kv_heads, 1.0);
    step.span_dense.assign(static_cast<size_t>(spans) * layers * kv_heads, 0.0);
    step.span_kept.assign(step.span_dense.size(), 0.0);
    step.span_held.assign(step.span_dense.size(), 0.0);
  }
  const AttentionOp op =
      rows.attention != nullptr ? rows.attention->ActionFor(layer.layer).op : AttentionOp::kDense;
  if (op == AttentionOp::kFixedBudget) {  // the full KV is not kept: the twin measures it
    step.measured = false;
    step.dense = false;
    step.kept.resize(static_cast<size_t>(layers) * kv_heads);
    for (int h = 0; h < kv_heads; ++h) {
      step.kept[static_cast<size_t>(layer.layer) * kv_heads + h] = attended_[e][h];
    }
    return;
  }
  const std::vector<int>* lists = nullptr;  // [kv_head]; null: every position
  if (teacher_kept != nullptr) {
    step.twin = true;
    lists = &(*teacher_kept)[static_cast<size_t>(layer.layer) * kv_heads];
    for (int h = 0; h < kv_heads; ++h) {
      if (static_cast<int>(lists[h].size()) < length) step.dense = false;
    }
  } else if (op != AttentionOp::kDense && !attended_[e].empty()) {
    lists = attended_[e].data();
    step.dense = false;
  }
  const bool dense = lists == nullptr;
  const int group = model_.num_heads / kv_heads;
  const int head_dim = model_.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const PagedKvView kv = layer.cache->LayerView(layer.layer, *rows.sequence);
  const float* query = layer.q + static_cast<size_t>(rows.first_token + t) * model_.q_dim();
  pooled_.resize(static_cast<size_t>(length));
  logits_.resize(static_cast<size_t>(length));
  mask_.resize(static_cast<size_t>(length));
  for (int h = 0; h < kv_heads; ++h) {
    std::fill(pooled_.begin(), pooled_.end(), 0.0);
    for (int g = 0; g < group; ++g) {
      const float* q = query + static_cast<size_t>(h * group + g) * head_dim;
      double max = -INFINITY;
      for (int j = 0; j < length; ++j) {
        logits_[j] = Dot(q, kv.keys + kv.Offset(j, h), head_dim) * scale;
        max = std::max(max, logits_[j]);
      }
      double sum = 0.0;
      for (int j = 0; j < length; ++j) sum += (logits_[j] = std::exp(logits_[j] - max));
      for (int j = 0; j < length; ++j) pooled_[j] += logits_[j] / sum / group;
    }
    std::fill(mask_.begin(), mask_.end(), dense ? 1 : 0);
    if (!dense) {
      for (int p : lists[h]) {
        if (p >= 0 && p < length) mask_[p] = 1;
      }
    }
    double kept = 0.0;
    for (int j = 0; j < length; ++j) kept += mask_[j] ? pooled_[j] : 0.0;
    const size_t cell = static_cast<size_t>(layer.layer) * kv_heads + h;
    step.share[cell] = kept;
    for (int s = 0; s < spans; ++s) {
      const auto [begin, end] = recorder_->spans[static_cast<size_t>(s)];
      double on_span = 0.0, kept_span = 0.0;
      int rows_in = 0, rows_held = 0;
      for (int j = std::max(0, begin); j < std::min(end, length); ++j) {
        on_span += pooled_[j];
        kept_span += mask_[j] ? pooled_[j] : 0.0;
        ++rows_in;
        rows_held += mask_[j] ? 1 : 0;
      }
      const size_t at = static_cast<size_t>(s) * layers * kv_heads + cell;
      step.span_dense[at] = on_span;
      step.span_kept[at] = kept_span;
      step.span_held[at] = rows_in > 0 ? static_cast<double>(rows_held) / rows_in : 1.0;
    }
  }
}

class ProbedPolicy final : public AttentionPolicy {
 public:
  ProbedPolicy(std::shared_ptr<AttentionPolicy> inner, ProbeRecorder* recorder)
      : inner_(std::move(inner)), recorder_(recorder) {}

  std::string_view name() const override { return inner_->name(); }
  const PolicyTraits& traits() const override { return inner_->traits(); }
  AttentionWindow window() const override { return inner_->window(); }
  Status UseTokenizer(const Tokenizer* tokenizer) override {
    return inner_->UseTokenizer(tokenizer);
  }
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model,
                                                        int max_batch) const override {
    if (model.backend_name() != "cpu") {
      return UnsupportedError("rubato_fidelity: the probe runs on the CPU model only");
    }
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<AttentionBackend> inner,
                            inner_->MakeBackend(model, max_batch));
    std::unique_ptr<CpuAttentionBackend> cpu(dynamic_cast<CpuAttentionBackend*>(inner.get()));
    if (inner != nullptr && cpu == nullptr) {
      return InternalError("rubato_fidelity: the policy's backend is not a CPU backend");
    }
    inner.release();
    return std::unique_ptr<AttentionBackend>(
        new ProbeBackend(std::move(cpu), model.config(), recorder_));
  }
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override {
    return inner_->Admit(residency);
  }
  Status CheckLimits(int max_context) const override { return inner_->CheckLimits(max_context); }
  Status RegisterMetrics(MetricsRegistry& registry) override {
    return inner_->RegisterMetrics(registry);
  }
  std::string StatsLine() const override { return inner_->StatsLine(); }

 private:
  std::shared_ptr<AttentionPolicy> inner_;
  ProbeRecorder* recorder_;
};

}  // namespace

std::shared_ptr<AttentionPolicy> MakeProbedPolicy(std::shared_ptr<AttentionPolicy> inner,
                                                  ProbeRecorder* recorder) {
  return std::make_shared<ProbedPolicy>(std::move(inner), recorder);
}

}  // namespace rubato
