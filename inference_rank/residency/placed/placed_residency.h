// The placed residency (docs/residency.md "Placement"): each request's KV lives on one tier,
// chosen at admission by free memory. This rank's paged cache is a tier like the others: a
// request is kept wholly local while the local pool has room for its whole sequence (beyond
// what the running requests may still take); otherwise its KV goes to the cache tier, whose
// cache ranks attend their own requests (one or several cache ranks, each request on the one
// with the most free budget; a GPU cache rank of this process). Within a layer the inference
// rank attends its local requests with its own dense kernels while each cache rank attends its
// requests, so the memory and the bandwidth of every card serve one batch. Dense attention only:
// a policy that selects rows on the cache rank is refused by name. A request that fits no tier
// is refused, naming the local pool and the cache ranks' refusal.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "inference_rank/residency/residency.h"
#include "inference_rank/residency/residency_setup.h"

namespace rubato {

class PlacedResidency final : public Residency {
 public:
  // Over `cache_tier`: the residency of the cache ranks (offloaded KV with attention on the
  // cache rank), whose requests this one places and whose model half serves the mixed batch.
  explicit PlacedResidency(std::shared_ptr<Residency> cache_tier);

  std::string_view name() const override { return "placed"; }
  KvResidency kind() const override { return KvResidency::kOffloaded; }

  // Dense attention (no policy, or one whose cache-rank selector attends there), and what the
  // cache tier checks.
  Status Check(const AttentionPolicy* policy) const override;
  // Attaches the cache tier (its model half serves local and offloaded entries of one batch);
  // FailedPrecondition when the tier reads anything locally for its requests (its local window
  // is not 0), since placement then frees no local memory.
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  // Offloaded requests read nothing locally: the block being written is kept.
  int LocalWindow() const override { return 0; }
  // Local while reserved_tokens <= local_room_tokens, else on the cache tier.
  Result<std::unique_ptr<ResidencyRequest>> Admit(uint64_t request_id, int reserved_tokens,
                                                  int local_room_tokens) override;
  // On the cache tier (what Admit does without local room).
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  Status Close(ResidencyRequest& request) override;
  // The cache tier's: its loss ends only the requests placed there (the engine keeps the
  // wholly local ones).
  Status Broken() const override { return cache_tier_->Broken(); }
  Status RequestBroken(const ResidencyRequest& request) const override;

  Status RegisterMetrics(MetricsRegistry& registry) override;
  // " placed_local=N placed_cache=M" (requests admitted to each tier so far), then the cache
  // tier's line.
  std::string StatsLine() const override;

  uint64_t placed_local() const { return placed_local_; }
  uint64_t placed_cache() const { return placed_cache_; }

 private:
  std::shared_ptr<Residency> cache_tier_;
  uint64_t placed_local_ = 0;
  uint64_t placed_cache_ = 0;
  Counter* placed_metric_local_ = nullptr;
  Counter* placed_metric_cache_ = nullptr;
};

// Ok when `policy` (null: dense) attends on the cache rank; Unsupported naming it otherwise.
Status CheckPlacedPolicy(const AttentionPolicy* policy);

// The residency table's factory (residency_registry.cc): the offloaded residency of the
// config's cache ranks (topology.cache_endpoints, or one in this process: cache.memory device
// puts it on a GPU of this process) as the cache tier.
Result<std::shared_ptr<Residency>> CreatePlacedResidency(const ResidencySetup& setup);

}  // namespace rubato
