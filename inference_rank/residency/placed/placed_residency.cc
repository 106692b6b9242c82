// The placed residency's engine half (see placed_residency.h).
#include "inference_rank/residency/placed/placed_residency.h"

#include <fmt/format.h>

#include <utility>

#include "cache_rank/cache_selector.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"

#ifdef RUBATO_HAS_CUDA
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"
#endif

namespace rubato {
namespace {

// A request kept wholly in this rank's paged cache: no handle on its entries (the model half
// attends them locally), nothing to close.
class PlacedLocalRequest final : public ResidencyRequest {
 public:
  void AttachTo(ForwardEntry& /*entry*/) const override {}
  bool WhollyLocal() const override { return true; }
};

bool IsLocal(const ResidencyRequest& request) {
  return dynamic_cast<const PlacedLocalRequest*>(&request) != nullptr;
}

}  // namespace

PlacedResidency::PlacedResidency(std::shared_ptr<Residency> cache_tier)
    : cache_tier_(std::move(cache_tier)) {}

Status CheckPlacedPolicy(const AttentionPolicy* policy) {
  if (policy == nullptr) return Status::Ok();
  Result<CacheSelectorSpec> spec = policy->MakeCacheSelector();
  const CacheSelector* selector = spec.ok() ? FindCacheSelector(spec->name) : nullptr;
  if (selector != nullptr && selector->traits().partial_attention) return Status::Ok();
  return UnsupportedError(
      "engine.kv_residency: placed KV serves dense attention (each cache rank "
      "attends its own requests); policy '" +
      std::string(policy->name()) +
      "' selects rows on the cache rank, which needs engine.kv_residency "
      "offloaded");
}

Status PlacedResidency::Check(const AttentionPolicy* policy) const {
  RUBATO_RETURN_IF_ERROR(CheckPlacedPolicy(policy));
  return cache_tier_->Check(policy);
}

Status PlacedResidency::Attach(Model& model, const AttentionPolicy* policy, int max_batch) {
  RUBATO_RETURN_IF_ERROR(cache_tier_->Attach(model, policy, max_batch));
  const int window = cache_tier_->LocalWindow();
  if (window != 0) {
    return FailedPreconditionError(fmt::format(
        "engine.kv_residency: placed KV needs cache ranks that attend their requests and leave "
        "nothing to read locally, but the cache tier ({} KV on the {} model) keeps {} here; use "
        "cache.memory device with the CUDA model, or the CPU model",
        cache_tier_->name(), model.backend_name(),
        window < 0 ? std::string("every position") : fmt::format("a window of {}", window)));
  }
  return Status::Ok();
}

Result<std::unique_ptr<ResidencyRequest>> PlacedResidency::Admit(uint64_t request_id,
                                                                 int reserved_tokens,
                                                                 int local_room_tokens) {
  if (reserved_tokens <= local_room_tokens) {
    ++placed_local_;
    if (placed_metric_local_ != nullptr) placed_metric_local_->Increment();
    return std::unique_ptr<ResidencyRequest>(std::make_unique<PlacedLocalRequest>());
  }
  Result<std::unique_ptr<ResidencyRequest>> opened = cache_tier_->Open(request_id, reserved_tokens);
  if (!opened.ok()) {
    return Status(opened.status().code(),
                  fmt::format("no KV tier has room for its {} positions: this rank's KV pool can "
                              "take {} more (engine.kv_pool_tokens, "
                              "engine.gpu_memory_utilization), and the cache ranks: {}",
                              reserved_tokens + 1, local_room_tokens, opened.status().message()));
  }
  ++placed_cache_;
  if (placed_metric_cache_ != nullptr) placed_metric_cache_->Increment();
  return opened;
}

Result<std::unique_ptr<ResidencyRequest>> PlacedResidency::Open(uint64_t request_id,
                                                                int reserved_tokens) {
  return Admit(request_id, reserved_tokens, 0);
}

Status PlacedResidency::Close(ResidencyRequest& request) {
  if (IsLocal(request)) return Status::Ok();
  return cache_tier_->Close(request);
}

Status PlacedResidency::RequestBroken(const ResidencyRequest& request) const {
  if (IsLocal(request)) return Status::Ok();
  return cache_tier_->RequestBroken(request);
}

Status PlacedResidency::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(
      CounterFamily * placed,
      registry.AddCounterFamily("rubato:kv_requests_placed_total",
                                "Requests admitted, by the KV tier placement chose for them: this "
                                "rank's paged cache (local) or a cache rank (cache).",
                                {"tier"}));
  RUBATO_ASSIGN_OR_RETURN(placed_metric_local_, placed->WithLabels({"local"}));
  RUBATO_ASSIGN_OR_RETURN(placed_metric_cache_, placed->WithLabels({"cache"}));
  return cache_tier_->RegisterMetrics(registry);
}

std::string PlacedResidency::StatsLine() const {
  return fmt::format(" placed_local={} placed_cache={}", placed_local_, placed_cache_) +
         cache_tier_->StatsLine();
}

Result<std::shared_ptr<Residency>> CreatePlacedResidency(const ResidencySetup& setup) {
  RUBATO_RETURN_IF_ERROR(CheckPlacedPolicy(setup.policy));
  RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<Residency> cache_tier, CreateOffloadedResidency(setup));
#ifdef RUBATO_HAS_CUDA
  // A GPU cache rank of this process attends every decode row of its requests there: placement
  // keeps only the block being written of them on the inference GPU.
  if (auto* gpu = dynamic_cast<GpuCacheResidency*>(cache_tier.get())) gpu->set_local_window(0);
#endif
  return std::shared_ptr<Residency>(std::make_shared<PlacedResidency>(std::move(cache_tier)));
}

}  // namespace rubato
