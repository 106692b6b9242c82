// Several cache ranks behind one inference rank: MultiCacheRank is the engine's KvOffloadClient
// over M reconnecting cache ranks (any M >= 1). Each new request's session goes to the rank with
// the most free budget (cache_placement.h, from each rank's Stats RPC); its sessions' entries
// are routed to that rank in every layer. A rank that is lost (or whose data plane fails) loses
// only its sessions: SessionBroken names that rank, its exchange calls return placeholders the
// engine never reads (it ends those requests), and the other ranks' requests run on. Once every
// session of the lost rank is closed its ReconnectingCacheRank reconnects, and it takes new
// requests again. Broken() is an error only while no rank can take a request.
// Narrative: docs/disaggregated.md "Several cache ranks".
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/metrics.h"
#include "common/status.h"
#include "inference_rank/residency/offloaded/kv_offload.h"
#include "inference_rank/residency/offloaded/reconnecting_cache.h"

namespace rubato {

class MultiCacheRank final : public KvOffloadClient {
 public:
  struct Rank {
    std::string endpoint;  // its `rubato cache --listen` address, for error messages
    std::unique_ptr<ReconnectingCacheRank> link;
  };
  // `ranks` non-empty; `model` sizes the placeholders of lost sessions.
  MultiCacheRank(std::vector<Rank> ranks, const ModelConfig& model);
  MultiCacheRank(const MultiCacheRank&) = delete;
  MultiCacheRank& operator=(const MultiCacheRank&) = delete;

  // On the rank with the most free budget among those that work (kUnavailable naming every
  // rank when none does); the session id is this client's, not the rank's.
  Result<uint64_t> OpenSession(uint64_t request_id, int capacity_tokens) override;
  Status CloseSession(uint64_t session_id) override;
  // Ok while one rank works; else every rank's error.
  Status Broken() const override;
  // The session's rank's loss ("cache rank i of M (HOST:PORT): ..."), or ok.
  Status SessionBroken(uint64_t session_id) const override;

  Status LayerComputed(int layer, std::span<const OffloadLayerKv> entries) override;
  Result<OffloadCompactKv> CompactFor(int layer, uint64_t session_id, int position) override;
  bool ServesPartialAttention(uint64_t session_id) const override;
  Result<OffloadPartial> PartialFor(int layer, uint64_t session_id, int position) override;

  // Every rank's metrics on the same series (their sum), and rubato:cache_link_up 1 while one
  // rank works. `registry` must not be scraped after this is destroyed.
  Status RegisterMetrics(MetricsRegistry& registry);

  int num_ranks() const { return static_cast<int>(ranks_.size()); }
  ReconnectingCacheRank& rank(int index) { return *ranks_[static_cast<size_t>(index)].link; }

 private:
  struct Placed {
    int rank = 0;
    uint64_t rank_session = 0;  // the session id on that rank
  };
  struct RankState {
    Status failed;  // a data-plane call of this rank failed; cleared once its sessions closed
    int sessions = 0;
  };
  // "cache rank i of M (HOST:PORT): why" unless `why` already names the endpoint.
  Status Named(int rank, const Status& why) const;
  Status RankLostLocked(int rank) const;
  // Where `session_id` lives: its placement, or nullopt when its rank is lost (the caller
  // returns a placeholder); NotFound for an unknown session.
  Result<std::optional<Placed>> LivePlacement(uint64_t session_id) const;
  // Records a failed data-plane call of `rank`: its sessions are lost.
  void FailRankLocked(int rank, const Status& why);

  std::vector<Rank> ranks_;
  ModelConfig model_;
  mutable std::mutex mutex_;  // guards the fields below (the links lock themselves)
  std::vector<RankState> state_;
  std::map<uint64_t, Placed> sessions_;
  uint64_t next_session_ = 1;
  // Per layer, the entries of each rank (session ids of that rank), rebuilt by LayerComputed.
  std::vector<std::vector<OffloadLayerKv>> routed_;
  // What a lost session's exchange calls return: zeros, never read by the engine.
  std::vector<float> placeholder_rows_;  // [num_heads][head_dim] f32 (and the compact keys)
  std::vector<float> placeholder_lse_;   // [num_heads] f32
  std::vector<int> placeholder_counts_;  // [num_kv_heads], zeros
};

}  // namespace rubato
