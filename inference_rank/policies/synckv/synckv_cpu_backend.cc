// SyncKV's CPU backend half (see synckv_cpu_backend.h).
#include "inference_rank/policies/synckv/synckv_cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/policies/synckv/synckv_policy.h"
#include "inference_rank/residency/split_by_head/split_by_head_kv.h"
#include "kernels/cpu/dot.h"

namespace rubato {
namespace {

class SyncKvCpuBackend final : public CpuAttentionBackend {
 public:
  SyncKvCpuBackend(const ModelConfig& model, const SyncKvPolicy& policy)
      : model_(model), policy_(policy) {}

  Status BeforeAttention(const CpuLayerContext& context) override {
    for (size_t e = 0; e < context.entries.size(); ++e) {
      const CpuEntryRows& p = context.entries[e];
      if (p.attention == nullptr) continue;
      const auto* step = static_cast<const SyncKvStep*>(p.attention->state);
      if (step->kind == SyncKvStep::Kind::kSuspension) continue;
      const auto* handle = dynamic_cast<const SplitByHeadEntry*>(p.residency);
      if (handle == nullptr) {
        return FailedPreconditionError(
            "policy synckv: batch entry " + std::to_string(e) +
            " has no split_by_head KV (engine.kv_residency must be split_by_head)");
      }
      RUBATO_RETURN_IF_ERROR(Select(context, p, *step, *handle->kv));
    }
    return Status::Ok();
  }

  Result<CompactSegment> Compact(const CpuLayerContext& /*layer*/, int /*entry*/) override {
    return InternalError("policy synckv: its plans hold no two-segment op");
  }

 private:
  // The R-head `kv_head`'s probabilities over [0, position] for the entry's last query, the max
  // over its GQA group (the attention op's scale and dot product).
  void Scores(const CpuLayerContext& context, const CpuEntryRows& p, int kv_head) {
    const int position = p.start_position + p.tokens - 1;
    const int group = model_.num_heads / model_.num_kv_heads;
    const int head_dim = model_.head_dim;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    const PagedKvView kv = context.cache->LayerView(context.layer, *p.sequence);
    scores_.assign(static_cast<size_t>(position) + 1, 0.0f);
    logits_.resize(static_cast<size_t>(position) + 1);
    for (int g = 0; g < group; ++g) {
      const float* query =
          context.q + (static_cast<size_t>(p.first_token + p.tokens - 1) * model_.num_heads +
                       kv_head * group + g) *
                          head_dim;
      double max = -INFINITY;
      for (int i = 0; i <= position; ++i) {
        logits_[i] = Dot(query, kv.keys + kv.Offset(i, kv_head), head_dim) * scale;
        max = std::max(max, logits_[i]);
      }
      double sum = 0.0;
      for (int i = 0; i <= position; ++i) sum += (logits_[i] = std::exp(logits_[i] - max));
      for (int i = 0; i <= position; ++i) {
        scores_[i] = std::max(scores_[i], static_cast<float>(logits_[i] / sum));
      }
    }
  }

  Status Select(const CpuLayerContext& context, const CpuEntryRows& p, const SyncKvStep& step,
                SplitByHeadKv& kv) {
    const int layer = context.layer;
    const HeadSplit& split = policy_.head_split();
    const int clusters = split.clusters(layer);
    const int context_length = p.start_position + p.tokens;
    const int budget = policy_.Budget(context_length);
    std::vector<std::vector<int>> static_sets(static_cast<size_t>(clusters));
    std::vector<std::vector<int>> dynamic_sets(static_cast<size_t>(clusters));
    for (int g = 0; g < clusters; ++g) {
      Scores(context, p, split.representative[layer][g]);
      if (step.kind == SyncKvStep::Kind::kPromptEnd) {
        // Eq. 3-4: I_0 = top-k; the static set its floor(rho k) most attended positions.
        std::vector<int> top = SyncKvTopK(scores_, budget, {});
        const size_t fixed =
            static_cast<size_t>(std::floor(policy_.config().static_ratio * budget));
        static_sets[g].assign(top.begin(), top.begin() + static_cast<long>(fixed));
        dynamic_sets[g].assign(top.begin() + static_cast<long>(fixed), top.end());
      } else {
        // Eq. 6: the dynamic budget is what the static set leaves of k (k grows with the context).
        const std::vector<int>& fixed = kv.StaticSet(layer, g);
        const int dynamic = std::max(0, budget - static_cast<int>(fixed.size()));
        dynamic_sets[g] = SyncKvTopK(scores_, dynamic, fixed);
      }
    }
    if (step.kind == SyncKvStep::Kind::kPromptEnd) {
      kv.SelectInitial(layer, std::move(static_sets), std::move(dynamic_sets));
    } else {
      kv.Anticipate(layer, std::move(dynamic_sets));
    }
    return Status::Ok();
  }

  ModelConfig model_;
  const SyncKvPolicy& policy_;
  std::vector<float> scores_;
  std::vector<double> logits_;
};

}  // namespace

std::vector<int> SyncKvTopK(const std::vector<float>& scores, int k,
                            const std::vector<int>& excluded) {
  std::vector<int> order;
  order.reserve(scores.size());
  for (int i = 0; i < static_cast<int>(scores.size()); ++i) {
    if (!std::binary_search(excluded.begin(), excluded.end(), i)) order.push_back(i);
  }
  const size_t n = std::min(order.size(), static_cast<size_t>(std::max(0, k)));
  std::partial_sort(
      order.begin(), order.begin() + static_cast<long>(n), order.end(),
      [&scores](int a, int b) { return scores[a] != scores[b] ? scores[a] > scores[b] : a < b; });
  order.resize(n);
  return order;
}

std::unique_ptr<AttentionBackend> MakeSyncKvCpuBackend(const ModelConfig& model,
                                                       const SyncKvPolicy& policy) {
  return std::make_unique<SyncKvCpuBackend>(model, policy);
}

}  // namespace rubato
