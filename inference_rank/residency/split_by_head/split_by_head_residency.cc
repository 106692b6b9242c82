// The split_by_head residency's engine half (see split_by_head_residency.h).
#include "inference_rank/residency/split_by_head/split_by_head_residency.h"

#include <cstdio>

#include "inference_rank/residency/split_by_head/split_by_head_cpu_backend.h"

namespace rubato {
namespace {

class SplitByHeadRequest final : public ResidencyRequest {
 public:
  SplitByHeadRequest(const HeadSplit& split, int head_dim, int capacity, KvFetcher& fetcher,
                     SplitByHeadCounters& counters)
      : kv_(split, head_dim, capacity, fetcher, counters) {
    entry_.kv = &kv_;
  }
  void AttachTo(ForwardEntry& entry) const override { entry.residency = &entry_; }

 private:
  SplitByHeadKv kv_;
  SplitByHeadEntry entry_;
};

}  // namespace

SplitByHeadResidency::SplitByHeadResidency(std::shared_ptr<KvFetcher> fetcher)
    : fetcher_(fetcher != nullptr ? std::move(fetcher)
                                  : std::shared_ptr<KvFetcher>(MakeThreadKvFetcher())) {}

Status SplitByHeadResidency::Check(const AttentionPolicy* policy) const {
  if (dynamic_cast<const HeadSplitPolicy*>(policy) == nullptr) {
    return InvalidArgumentError(
        "engine.kv_residency: split_by_head needs a policy that names representative heads "
        "(synckv); policy '" +
        std::string(policy != nullptr ? policy->name() : "dense") + "' names none");
  }
  return Status::Ok();
}

Status SplitByHeadResidency::Attach(Model& model, const AttentionPolicy* policy,
                                    int /*max_batch*/) {
  RUBATO_RETURN_IF_ERROR(Check(policy));
  if (model.backend_name() != "cpu") {
    return UnsupportedError(
        "engine.kv_residency: split_by_head is built for the CPU model only, "
        "not the " +
        std::string(model.backend_name()) + " model");
  }
  const HeadSplit& split = dynamic_cast<const HeadSplitPolicy*>(policy)->head_split();
  const ModelConfig& config = model.config();
  if (split.num_layers != config.num_layers || split.num_kv_heads != config.num_kv_heads) {
    return InvalidArgumentError(
        "split_by_head: the policy's head split is for " + std::to_string(split.num_layers) +
        " layers x " + std::to_string(split.num_kv_heads) + " KV heads, the model has " +
        std::to_string(config.num_layers) + " x " + std::to_string(config.num_kv_heads));
  }
  split_ = &split;
  head_dim_ = config.head_dim;
  return model.SetResidencyBackend(
      std::make_unique<SplitByHeadCpuBackend>(split, *counters_, metrics_));
}

Result<std::unique_ptr<ResidencyRequest>> SplitByHeadResidency::Open(uint64_t /*request_id*/,
                                                                     int reserved_tokens) {
  if (split_ == nullptr) return FailedPreconditionError("split_by_head: Open before Attach");
  // reserved_tokens: every position the paged cache holds, which is every position forwarded.
  return std::unique_ptr<ResidencyRequest>(std::make_unique<SplitByHeadRequest>(
      *split_, head_dim_, std::max(1, reserved_tokens), *fetcher_, *counters_));
}

Status SplitByHeadResidency::CheckRedo() const {
  return FailedPreconditionError(
      "split_by_head KV: a step cannot be redone (its rows went to the offloaded store and its "
      "anticipation may have started a fetch)");
}

Status SplitByHeadResidency::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(metrics_.fetches,
                          registry.AddCounter("rubato:split_by_head_fetches_total",
                                              "Anticipation fetches, per request and layer."));
  RUBATO_ASSIGN_OR_RETURN(
      metrics_.rows_fetched,
      registry.AddCounter("rubato:split_by_head_rows_fetched_total",
                          "NR-head KV rows fetched from the offloaded store (the delta: rows "
                          "already local are not fetched)."));
  RUBATO_ASSIGN_OR_RETURN(metrics_.bytes_fetched,
                          registry.AddCounter("rubato:split_by_head_bytes_fetched_total",
                                              "K and V bytes of the rows fetched."));
  RUBATO_ASSIGN_OR_RETURN(
      metrics_.exposed_wait_seconds,
      registry.AddCounter("rubato:split_by_head_exposed_fetch_wait_seconds_total",
                          "Time steps waited for a fetch that had not arrived."));
  RUBATO_ASSIGN_OR_RETURN(
      metrics_.local_kv_share,
      registry.AddGauge("rubato:split_by_head_local_kv_share",
                        "The last step's local KV bytes over the full KV of its requests."));
  return Status::Ok();
}

std::string SplitByHeadResidency::StatsLine() const {
  const SplitByHeadCounters& c = *counters_;
  char share[32] = "-";
  if (c.full_kv_bytes > 0) {
    std::snprintf(share, sizeof(share), "%.3f",
                  static_cast<double>(c.local_kv_bytes) / static_cast<double>(c.full_kv_bytes));
  }
  char wait[32];
  std::snprintf(wait, sizeof(wait), "%.3f", static_cast<double>(c.exposed_wait_ns) * 1e-9);
  return " split_by_head_fetches=" + std::to_string(c.fetches) +
         " split_by_head_rows_fetched=" + std::to_string(c.rows_fetched) +
         " split_by_head_bytes_fetched=" + std::to_string(c.bytes_fetched) +
         " split_by_head_rows_reused=" + std::to_string(c.rows_reused) +
         " split_by_head_exposed_wait_s=" + wait + " split_by_head_local_kv_share=" + share;
}

Result<std::shared_ptr<Residency>> CreateSplitByHeadResidency(const ResidencySetup& /*setup*/) {
  return std::shared_ptr<Residency>(std::make_shared<SplitByHeadResidency>());
}

}  // namespace rubato
