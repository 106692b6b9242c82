// MultiCacheRank (multi_cache.h): placement by free budget, routing per rank, losses per rank.
#include "inference_rank/residency/offloaded/multi_cache.h"

#include <fmt/format.h>

#include <utility>

#include "common/logging.h"
#include "inference_rank/residency/offloaded/cache_placement.h"

namespace rubato {

MultiCacheRank::MultiCacheRank(std::vector<Rank> ranks, const ModelConfig& model)
    : ranks_(std::move(ranks)), model_(model), state_(ranks_.size()), routed_(ranks_.size()) {
  placeholder_rows_.assign(static_cast<size_t>(model.num_heads) * model.head_dim, 0.0f);
  placeholder_lse_.assign(static_cast<size_t>(model.num_heads), 0.0f);
  placeholder_counts_.assign(static_cast<size_t>(model.num_kv_heads), 0);
}

Status MultiCacheRank::Named(int rank, const Status& why) const {
  if (ranks_.size() == 1) return why;  // the rank's own messages name its endpoint
  const std::string& endpoint = ranks_[static_cast<size_t>(rank)].endpoint;
  std::string message = why.message();
  // "cache rank HOST:PORT: ..." (the rank's own naming) says the endpoint a second time.
  const std::string own = "cache rank " + endpoint + ": ";
  if (message.rfind(own, 0) == 0) message.erase(0, own.size());
  return Status(why.code(), fmt::format("cache rank {} of {} ({}): {}", rank, ranks_.size(),
                                        endpoint, message));
}

Status MultiCacheRank::RankLostLocked(int rank) const {
  const RankState& state = state_[static_cast<size_t>(rank)];
  if (!state.failed.ok()) return state.failed;  // named when recorded
  const Status broken = ranks_[static_cast<size_t>(rank)].link->Broken();
  return broken.ok() ? broken : Named(rank, broken);
}

void MultiCacheRank::FailRankLocked(int rank, const Status& why) {
  RankState& state = state_[static_cast<size_t>(rank)];
  if (!state.failed.ok()) return;
  state.failed = Named(rank, why);
  RUBATO_LOG_WARN("offload", "{}; its {} request(s) end, the other cache ranks serve on",
                  state.failed.message(), state.sessions);
}

Result<uint64_t> MultiCacheRank::OpenSession(uint64_t request_id, int capacity_tokens) {
  std::vector<Status> lost(ranks_.size());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int r = 0; r < num_ranks(); ++r) lost[static_cast<size_t>(r)] = RankLostLocked(r);
  }
  // The free budgets without the lock (Broken() from a health thread does not wait on RPCs):
  // one Stats call per working rank and admission; a single rank needs none.
  std::vector<CacheRankBudget> budgets(ranks_.size());
  std::string why_none;
  for (int r = 0; r < num_ranks(); ++r) {
    Status& rank_lost = lost[static_cast<size_t>(r)];
    if (rank_lost.ok() && ranks_.size() > 1) {
      const Result<rpc::StatsResponse> stats = ranks_[static_cast<size_t>(r)].link->Stats();
      if (stats.ok()) {
        const uint64_t used = stats->bytes_in_use();
        budgets[static_cast<size_t>(r)] = {
            true, stats->bytes_capacity() > used ? stats->bytes_capacity() - used : 0};
      } else {
        rank_lost = Named(r, stats.status());
      }
    } else if (rank_lost.ok()) {
      budgets[static_cast<size_t>(r)].available = true;
    }
    if (!rank_lost.ok()) why_none += (why_none.empty() ? "" : "; ") + rank_lost.message();
  }
  const int rank = PickCacheRank(budgets);
  if (rank < 0) {
    if (ranks_.size() == 1) return lost.front();
    return UnavailableError("no cache rank can take request " + std::to_string(request_id) + ": " +
                            why_none);
  }
  Result<uint64_t> opened =
      ranks_[static_cast<size_t>(rank)].link->OpenSession(request_id, capacity_tokens);
  if (!opened.ok()) return Named(rank, opened.status());
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t session = next_session_++;
  sessions_[session] = Placed{rank, *opened};
  ++state_[static_cast<size_t>(rank)].sessions;
  RUBATO_LOG_DEBUG("offload", "request {} on cache rank {} ({})", request_id, rank,
                   ranks_[static_cast<size_t>(rank)].endpoint);
  return session;
}

Status MultiCacheRank::CloseSession(uint64_t session_id) {
  Placed placed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = sessions_.find(session_id);
    if (found == sessions_.end()) {
      return NotFoundError("offload: no session " + std::to_string(session_id));
    }
    placed = found->second;
    sessions_.erase(found);
    RankState& state = state_[static_cast<size_t>(placed.rank)];
    // The last session of a failed rank: its link may now reconnect and take new requests.
    if (--state.sessions == 0) state.failed = Status::Ok();
  }
  return ranks_[static_cast<size_t>(placed.rank)].link->CloseSession(placed.rank_session);
}

Status MultiCacheRank::Broken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ranks_.size() == 1) return RankLostLocked(0);
  std::string why;
  for (int r = 0; r < num_ranks(); ++r) {
    const Status lost = RankLostLocked(r);
    if (lost.ok()) return Status::Ok();
    why += (why.empty() ? "" : "; ") + lost.message();
  }
  return UnavailableError("every cache rank is lost: " + why);
}

Status MultiCacheRank::SessionBroken(uint64_t session_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto found = sessions_.find(session_id);
  if (found == sessions_.end()) return Status::Ok();
  return RankLostLocked(found->second.rank);
}

Status MultiCacheRank::LayerComputed(int layer, std::span<const OffloadLayerKv> entries) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (std::vector<OffloadLayerKv>& routed : routed_) routed.clear();
  for (const OffloadLayerKv& entry : entries) {
    const auto found = sessions_.find(entry.session_id);
    if (found == sessions_.end()) {
      return NotFoundError("offload: layer " + std::to_string(layer) + " hands over session " +
                           std::to_string(entry.session_id) + ", which is not open");
    }
    OffloadLayerKv routed = entry;
    routed.session_id = found->second.rank_session;
    routed_[static_cast<size_t>(found->second.rank)].push_back(routed);
  }
  std::vector<bool> send(ranks_.size(), false);
  for (int r = 0; r < num_ranks(); ++r) {
    send[static_cast<size_t>(r)] =
        !routed_[static_cast<size_t>(r)].empty() && RankLostLocked(r).ok();
  }
  lock.unlock();
  // Each rank's pack outside the lock (a send may wait); a rank whose data plane fails loses
  // its sessions only.
  for (int r = 0; r < num_ranks(); ++r) {
    if (!send[static_cast<size_t>(r)]) continue;
    const Status sent =
        ranks_[static_cast<size_t>(r)].link->LayerComputed(layer, routed_[static_cast<size_t>(r)]);
    if (!sent.ok()) {
      lock.lock();
      FailRankLocked(r, sent);
      lock.unlock();
    }
  }
  return Status::Ok();
}

Result<std::optional<MultiCacheRank::Placed>> MultiCacheRank::LivePlacement(
    uint64_t session_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto found = sessions_.find(session_id);
  if (found == sessions_.end()) {
    return NotFoundError("offload: no session " + std::to_string(session_id));
  }
  if (!RankLostLocked(found->second.rank).ok()) return std::optional<Placed>();
  return std::optional<Placed>(found->second);
}

Result<OffloadCompactKv> MultiCacheRank::CompactFor(int layer, uint64_t session_id, int position) {
  RUBATO_ASSIGN_OR_RETURN(const std::optional<Placed> placed, LivePlacement(session_id));
  const int rank = placed ? placed->rank : -1;
  const uint64_t rank_session = placed ? placed->rank_session : 0;
  if (rank >= 0) {
    Result<OffloadCompactKv> compact =
        ranks_[static_cast<size_t>(rank)].link->CompactFor(layer, rank_session, position);
    if (compact.ok()) return compact;
    std::lock_guard<std::mutex> lock(mutex_);
    FailRankLocked(rank, compact.status());
  }
  // A lost session: no compact rows, the token alone (the engine discards the result).
  OffloadCompactKv placeholder;
  placeholder.compact = CompactKvView{placeholder_rows_.data(), placeholder_rows_.data(),
                                      model_.num_kv_heads, 0, model_.head_dim};
  placeholder.counts = placeholder_counts_.data();
  placeholder.recent_begin = position;
  return placeholder;
}

bool MultiCacheRank::ServesPartialAttention(uint64_t session_id) const {
  int rank = -1;
  uint64_t rank_session = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = sessions_.find(session_id);
    if (found == sessions_.end()) return false;
    rank = found->second.rank;
    rank_session = found->second.rank_session;
  }
  return ranks_[static_cast<size_t>(rank)].link->ServesPartialAttention(rank_session);
}

Result<OffloadPartial> MultiCacheRank::PartialFor(int layer, uint64_t session_id, int position) {
  RUBATO_ASSIGN_OR_RETURN(const std::optional<Placed> placed, LivePlacement(session_id));
  const int rank = placed ? placed->rank : -1;
  const uint64_t rank_session = placed ? placed->rank_session : 0;
  if (rank >= 0) {
    Result<OffloadPartial> partial =
        ranks_[static_cast<size_t>(rank)].link->PartialFor(layer, rank_session, position);
    if (partial.ok()) return partial;
    std::lock_guard<std::mutex> lock(mutex_);
    FailRankLocked(rank, partial.status());
  }
  // A lost session: zeros (the engine discards the result).
  return OffloadPartial{placeholder_rows_.data(), placeholder_lse_.data()};
}

Status MultiCacheRank::RegisterMetrics(MetricsRegistry& registry) {
  // The same series for every rank (registering a definition again returns its family), so
  // the transport bytes, waits and RPC latencies are the sum over the ranks.
  for (Rank& rank : ranks_) RUBATO_RETURN_IF_ERROR(rank.link->RegisterMetrics(registry));
  if (ranks_.size() == 1) return Status::Ok();
  // rubato:cache_link_up: 1 while one rank takes requests (what /health says), set after the
  // ranks' own collectors, which each report one link.
  RUBATO_ASSIGN_OR_RETURN(Gauge * link_up,
                          registry.AddGauge("rubato:cache_link_up",
                                            "1 while the cache rank answers heartbeats and the "
                                            "data plane works, else 0."));
  registry.AddCollector([this, link_up] { link_up->Set(Broken().ok() ? 1.0 : 0.0); });
  return Status::Ok();
}

}  // namespace rubato
