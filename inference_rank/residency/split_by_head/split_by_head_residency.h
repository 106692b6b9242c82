// The split_by_head residency (docs/residency.md, docs/synckv.md): per layer the representative
// heads' (R-heads') KV stays whole in the paged cache; the other heads' (NR-heads') full KV goes
// to an offloaded store and they attend a local front (their cluster's static and dynamic sets)
// plus the positions since the last selection. The policy names the heads (HeadSplitPolicy:
// SyncKV) and chooses the sets; this residency stores, fetches and attends.
//
// CPU engine: the store in this process's host memory, fetched by a worker thread; the paged
// cache still holds every head's rows (the model appends whole positions), the residency reads
// the NR-heads' rows from it only for the recent positions, and the saving is what LocalBytes
// counts. CUDA model (split_by_head_cuda_kv.h): the R-heads' KV and the NR-heads' compact pools
// in device storage allocated at Attach, the store in pinned host memory or on another GPU of
// this process, and the paged cache keeps only a local window. Not built: the store on a cache
// rank of another process.
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

class SplitByHeadDeviceKv;

class SplitByHeadResidency final : public Residency {
 public:
  // `fetcher`: runs the CPU engine's anticipation fetches (null: one worker thread).
  // `context_capacity`: the positions a request may reach on the CUDA model, whose device
  // storage is allocated for it at Attach (0: the model's max_position_embeddings).
  explicit SplitByHeadResidency(std::shared_ptr<KvFetcher> fetcher = nullptr,
                                int context_capacity = 0);
  ~SplitByHeadResidency() override;

  std::string_view name() const override { return "split_by_head"; }
  KvResidency kind() const override { return KvResidency::kSplitByHead; }

  // InvalidArgument for a policy that names no representative heads (not a HeadSplitPolicy).
  Status Check(const AttentionPolicy* policy) const override;
  // The CPU or CUDA model half (the CUDA one with its device storage for max_batch requests);
  // Unsupported on another model; the split must fit the model's shape.
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  // CUDA: the recent positions the NR-heads read in place, plus the two-segment kernel's tile
  // of 64 (it reads from recent_begin rounded down to a tile). CPU: every position.
  int LocalWindow() const override { return local_window_; }
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  Status Close(ResidencyRequest& request) override;
  // A step appended its rows to the store and may have started a fetch: it cannot be redone.
  Status CheckRedo() const override;
  Status RegisterMetrics(MetricsRegistry& registry) override;
  std::string StatsLine() const override;

  const SplitByHeadCounters& counters() const { return *counters_; }
  // CUDA: the device bytes of the residency's storage (R-heads' pools, compact pools, books);
  // 0 on the CPU model.
  size_t device_bytes() const;
  // CUDA: the device storage (benchmarks fill it); null on the CPU model.
  SplitByHeadDeviceKv* device_kv() const { return device_kv_.get(); }

 private:
  std::shared_ptr<KvFetcher> fetcher_;
  // Shared with the model half, which may outlive this object inside the model.
  std::shared_ptr<SplitByHeadCounters> counters_ = std::make_shared<SplitByHeadCounters>();
  SplitByHeadMetrics metrics_;        // the model half publishes to it; lives as long as the engine
  const HeadSplit* split_ = nullptr;  // the policy's, from Attach
  int head_dim_ = 0;
  int context_capacity_ = 0;
  int local_window_ = -1;
  std::shared_ptr<SplitByHeadDeviceKv> device_kv_;  // CUDA model only
};

// The residency table's factory (residency_registry.cc).
Result<std::shared_ptr<Residency>> CreateSplitByHeadResidency(const ResidencySetup& setup);

}  // namespace rubato
