// The offloaded residency's engine half (docs/design.md §3 "KV residency", docs/disaggregated.md):
// every request gets a session on a cache rank at admission (capacity: its reserved positions + 1,
// the last sampled token's), its forward entries carry the session (OffloadForward) to the
// model half, which hands their K/V over and decodes through the compact KV the cache rank
// returns, and the session is closed when the request ends. The cache rank's selector (the
// policy's cache-rank half) chooses the rows. When the client breaks (the cache rank died or
// stalled), the engine ends every request with an error event; requests that fail to open a
// session end alike.
#pragma once

#include <memory>
#include <string>

#include "cache_rank/cache_selector.h"
#include "common/config.h"
#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/residency/offloaded/cache_client.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/residency/offloaded/kv_offload.h"
#include "inference_rank/residency/offloaded/multi_cache.h"
#include "inference_rank/residency/residency.h"
#include "inference_rank/residency/residency_setup.h"

namespace rubato {

// Where offloaded KV goes: the remote cache ranks (each reconnected when lost; requests placed
// by free budget), or one in this process.
struct OffloadTarget {
  std::unique_ptr<MultiCacheRank> remote;
  std::unique_ptr<ColocatedCacheRank> colocated;
  KvOffloadClient* client = nullptr;
  CacheSelectorSpec selection;  // what every session asks the cache ranks for
  // A current connection's client (the colocated one, or the first remote rank connected);
  // null without one.
  CacheRankClient* data_client() const {
    if (remote != nullptr) {
      for (int r = 0; r < remote->num_ranks(); ++r) {
        if (RemoteCacheRank* rank = remote->rank(r).current()) return &rank->client();
      }
      return nullptr;
    }
    return colocated != nullptr ? &colocated->client() : nullptr;
  }
};

// The cache ranks of `config` for sessions selecting with `selection`: topology.mode
// disaggregated connects to every topology.cache_endpoints entry (each reconnected when lost),
// colocated makes one in this process.
Result<OffloadTarget> ConnectOffload(const RubatoConfig& config, const CacheSelectorSpec& selection,
                                     const ModelConfig& model);

class OffloadedResidency final : public Residency {
 public:
  // Over `client`, which the caller owns and keeps alive longer (tests: a ColocatedCacheRank's
  // client, which is also `data_client`, the one whose counters StatsLine reads).
  explicit OffloadedResidency(KvOffloadClient& client, CacheRankClient* data_client = nullptr);
  // Owning the cache-rank connection.
  explicit OffloadedResidency(OffloadTarget target);

  std::string_view name() const override { return "offloaded"; }
  KvResidency kind() const override { return KvResidency::kOffloaded; }

  // Installs the model half of the model's backend (CPU, or CUDA in a CUDA build) and, on the
  // CPU model, derives the local window from the sessions' selection (LocalWindowFor): the
  // target's, else the data client's, else the policy's cache-rank selector.
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  // The CPU model's window; the CUDA model's: -1 (every position, as before).
  int LocalWindow() const override { return local_window_; }
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  // Closed even on a broken client, which then only forgets it; the error is logged, and only
  // while the client works.
  Status Close(ResidencyRequest& request) override;
  Status Broken() const override { return client_->Broken(); }
  Status RequestBroken(const ResidencyRequest& request) const override;

  // rubato:transport_bytes_total and rubato:pack_wait_seconds (CacheRankClient::RegisterMetrics).
  Status RegisterMetrics(MetricsRegistry& registry) override;
  // " offload_bytes_sent=... offload_bytes_received=... pack_wait_ms=...".
  std::string StatsLine() const override;

  KvOffloadClient& client() { return *client_; }
  CacheRankClient* data_client() const;

 private:
  OffloadTarget target_;  // empty over a caller's client
  KvOffloadClient* client_ = nullptr;
  CacheRankClient* data_client_ = nullptr;  // over a caller's client
  int local_window_ = -1;                   // set by Attach
};

// The positions before the one being written that an offloaded request reads in this rank's
// paged cache once its prompt is prefilled (docs/residency.md "The local window"), from the
// cache-rank selection its sessions ask for: 0 when the cache rank attends (nothing is
// read; the block being written is kept), p - recent_begin for a selector that replies rows
// (its recent segment [recent_begin, p] is read in place: recent_tokens - 1 for oracle_topk and
// asyncspade), -1 (every position) with a dense warm-up (dense_steps > 0 reads the whole
// context locally).
Result<int> LocalWindowFor(const CacheSelectorSpec& selection);

// Ok when `policy` (null: dense) runs on a GPU cache rank of this process, which computes the
// attention itself (its cache selector's partial_attention trait) or selects oracle_topk's rows,
// or asyncspade's one step ahead (gpu_cache_topk.h); else Unsupported naming the policy and
// cache.memory.
Status CheckGpuCachePolicy(const AttentionPolicy* policy);

// The residency table's factory (residency_registry.cc): ConnectOffload with the policy's
// cache-rank selector (dense without a policy).
Result<std::shared_ptr<Residency>> CreateOffloadedResidency(const ResidencySetup& setup);

}  // namespace rubato
