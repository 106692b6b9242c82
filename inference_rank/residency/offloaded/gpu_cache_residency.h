// The offloaded residency with its cache rank on a GPU of this process (`cache.memory: device`,
// the colocated mode, the CUDA model). Each request gets a session in the cache GPU's paged store
// at admission; the model half sends every layer's q|k|v rows there, with stream waits on events
// only, so its decode steps replay as CUDA graphs. Dense (GpuCacheAttention): the cache GPU
// attends and the decode rows' attention output comes back (the KV is never shipped).
// oracle_topk (GpuCacheTopK): the cache GPU selects and sends only the rows entering each
// selection into persistent compact pools on the model GPU, which attends them with its recent
// window. Another policy with a cache-rank selector (asyncspade) is refused by name.
// docs/disaggregated.md "Attention on a GPU cache rank in this process", "oracle_topk on a GPU
// cache rank in this process".
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/hf_config.h"
#include "inference_rank/residency/offloaded/gpu_cache_attention.h"
#include "inference_rank/residency/offloaded/gpu_cache_topk.h"
#include "inference_rank/residency/residency.h"

namespace rubato {

class GpuCacheResidency final : public Residency {
 public:
  // The store is made at Attach (it needs the model's device and max_batch): `cache` gives its
  // budget and GPU (-1: the model's), `max_context` the longest session, `max_step_rows` the
  // most tokens of one forward (decode tokens + prefill chunk tokens), `block_tokens` the
  // store's block (the engine's, so that the cache GPU's attention runs local dense's shapes).
  // `cache_devices`: several cache GPUs, each with the section's budget, a request on the one
  // with the most free blocks (empty: the section's one device).
  GpuCacheResidency(const CacheSection& cache, int max_context, int max_step_rows,
                    int block_tokens = 16, std::vector<int> cache_devices = {});

  std::string_view name() const override { return "offloaded"; }
  KvResidency kind() const override { return KvResidency::kOffloaded; }

  // Dense (no policy, or one whose cache-rank selector is attention on the cache rank) or
  // oracle_topk (its selector); another policy is refused by name.
  Status Check(const AttentionPolicy* policy) const override;
  // Makes the store on the cache GPU and installs the CUDA half; Unsupported on another model.
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  // -1 (every position stays in the model GPU's paged cache) unless set_local_window(0): the
  // placed residency's cache tier, whose requests' decode rows are attended on the cache GPU
  // and read nothing locally (docs/residency.md "Placement").
  int LocalWindow() const override { return local_window_; }
  void set_local_window(int window) { local_window_ = window; }
  // Before Attach: every attention launch of a step (the model GPU's and each cache GPU's) splits
  // the keys as one dense launch over the whole batch, so that each row has local dense's bits
  // (the tests); by default each GPU splits for its own rows, which keeps both GPUs busy when
  // placement shares the batch.
  void set_exact_splits(bool exact) { exact_splits_ = exact; }
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  Status Close(ResidencyRequest& request) override;

  Status RegisterMetrics(MetricsRegistry& registry) override;
  // " cache_bytes_out=... cache_bytes_back=... cache_device_mib=...".
  std::string StatsLine() const override;

  // false: oracle_topk's replies are full ones every step (topology.delta_replies); before
  // Attach.
  void set_delta_replies(bool on) { delta_replies_ = on; }

  // The first cache GPU's store, or null before Attach; attention(i) the i-th.
  GpuCacheAttention* attention(int i = 0) {
    return i < static_cast<int>(caches_.size()) ? caches_[static_cast<size_t>(i)].get() : nullptr;
  }
  int num_caches() const { return static_cast<int>(caches_.size()); }
  // Device bytes of every cache GPU's store, buffers and workspace.
  size_t device_bytes() const;
  // oracle_topk's exchange, or null before Attach or for dense.
  GpuCacheTopK* topk() { return topk_.get(); }

 private:
  // Counts every planned step's bytes in the metrics, once both exist.
  void ObserveSteps();

  CacheSection cache_;
  int max_context_ = 0;
  int max_step_rows_ = 0;
  int block_tokens_ = 16;
  int local_window_ = -1;
  bool exact_splits_ = false;
  bool delta_replies_ = true;
  std::vector<int> cache_devices_;
  std::vector<std::shared_ptr<GpuCacheAttention>> caches_;  // shared with the model half
  std::shared_ptr<GpuCacheTopK> topk_;  // oracle_topk: shared with the model half
  Counter* bytes_out_metric_ = nullptr;
  Counter* bytes_back_metric_ = nullptr;
  Gauge* device_bytes_metric_ = nullptr;
};

}  // namespace rubato
