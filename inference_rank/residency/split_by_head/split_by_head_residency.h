// The split_by_head residency (docs/residency.md, docs/synckv.md): per layer the representative
// heads' (R-heads') KV stays whole in the paged cache; the other heads' (NR-heads') full KV goes
// to an offloaded store and they attend a local front (their cluster's static and dynamic sets)
// plus the positions since the last selection. The policy names the heads (HeadSplitPolicy:
// SyncKV) and chooses the sets; this residency stores, fetches and attends.
//
// What is built: the CPU engine, the store in this process's host memory, fetched by a worker
// thread. The CPU paged cache still holds every head's rows (the model appends whole positions):
// the residency reads the NR-heads' rows from it only for the recent positions, and the saving
// is what LocalBytes counts. Not built: the CUDA model half (Attach refuses it), and the store on
// a cache rank (pinned host memory or another GPU).
#pragma once

#include <memory>

#include "common/status.h"
#include "inference_rank/attention/head_split.h"
#include "inference_rank/residency/residency.h"
#include "inference_rank/residency/residency_setup.h"
#include "inference_rank/residency/split_by_head/kv_fetcher.h"
#include "inference_rank/residency/split_by_head/split_by_head_cpu_backend.h"
#include "inference_rank/residency/split_by_head/split_by_head_kv.h"

namespace rubato {

class SplitByHeadResidency final : public Residency {
 public:
  // `fetcher`: runs the anticipation fetches (null: one worker thread).
  explicit SplitByHeadResidency(std::shared_ptr<KvFetcher> fetcher = nullptr);

  std::string_view name() const override { return "split_by_head"; }
  KvResidency kind() const override { return KvResidency::kSplitByHead; }

  // InvalidArgument for a policy that names no representative heads (not a HeadSplitPolicy).
  Status Check(const AttentionPolicy* policy) const override;
  // The CPU model half; Unsupported on another model; the split must fit the model's shape.
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  // A step appended its rows to the store and may have started a fetch: it cannot be redone.
  Status CheckRedo() const override;
  Status RegisterMetrics(MetricsRegistry& registry) override;
  std::string StatsLine() const override;

  const SplitByHeadCounters& counters() const { return *counters_; }

 private:
  std::shared_ptr<KvFetcher> fetcher_;
  // Shared with the model half, which may outlive this object inside the model.
  std::shared_ptr<SplitByHeadCounters> counters_ = std::make_shared<SplitByHeadCounters>();
  SplitByHeadMetrics metrics_;        // the model half publishes to it; lives as long as the engine
  const HeadSplit* split_ = nullptr;  // the policy's, from Attach
  int head_dim_ = 0;
};

// The residency table's factory (residency_registry.cc).
Result<std::shared_ptr<Residency>> CreateSplitByHeadResidency(const ResidencySetup& setup);

}  // namespace rubato
