// ReconnectingCacheRank (reconnecting_cache.h): forwarding, loss detection and the watcher.
#include "inference_rank/residency/offloaded/reconnecting_cache.h"

#include <utility>

#include "common/logging.h"

namespace rubato {

Result<std::unique_ptr<ReconnectingCacheRank>> ReconnectingCacheRank::Connect(
    Connector connect, ReconnectBackoff backoff) {
  std::unique_ptr<ReconnectingCacheRank> cache(new ReconnectingCacheRank());
  RUBATO_ASSIGN_OR_RETURN(cache->current_, connect(&cache->abandon_));
  cache->connect_ = std::move(connect);
  cache->backoff_ = backoff;
  cache->watcher_ = std::thread([raw = cache.get()] { raw->Watch(); });
  return cache;
}

std::unique_ptr<ReconnectingCacheRank> ReconnectingCacheRank::StartDisconnected(
    Connector connect, ReconnectBackoff backoff, Status why) {
  std::unique_ptr<ReconnectingCacheRank> cache(new ReconnectingCacheRank());
  cache->not_connected_ = UnavailableError("not connected yet: " + why.message());
  cache->connect_ = std::move(connect);
  cache->backoff_ = backoff;
  cache->watcher_ = std::thread([raw = cache.get()] { raw->Watch(); });
  return cache;
}

ReconnectingCacheRank::~ReconnectingCacheRank() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  abandon_ = true;  // an attempt in progress gives up instead of waiting out a stalled peer
  wake_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

Status ReconnectingCacheRank::BrokenLocked() const {
  if (current_ == nullptr) return not_connected_;
  RUBATO_RETURN_IF_ERROR(current_->client().Broken());
  if (!current_->rpc().Healthy()) {
    return UnavailableError("cache rank " + current_->endpoint() + " is lost (" +
                            current_->rpc().LostReason().message() + ")");
  }
  return Status::Ok();
}

Status ReconnectingCacheRank::Broken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return BrokenLocked();
}

Result<uint64_t> ReconnectingCacheRank::OpenSession(uint64_t request_id, int capacity_tokens) {
  std::lock_guard<std::mutex> lock(mutex_);
  RUBATO_RETURN_IF_ERROR(BrokenLocked());
  RUBATO_ASSIGN_OR_RETURN(const uint64_t session,
                          current_->client().OpenSession(request_id, capacity_tokens));
  open_sessions_.insert(session);
  return session;
}

Status ReconnectingCacheRank::CloseSession(uint64_t session_id) {
  Status closed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open_sessions_.erase(session_id);
    closed = current_ != nullptr ? current_->client().CloseSession(session_id)
                                 : not_connected_;  // no session opens before a connection
  }
  wake_.notify_all();  // the last one closed: the watcher may reconnect
  return closed;
}

Status ReconnectingCacheRank::LayerComputed(int layer, std::span<const OffloadLayerKv> entries) {
  return current_->client().LayerComputed(layer, entries);
}

Result<OffloadCompactKv> ReconnectingCacheRank::CompactFor(int layer, uint64_t session_id,
                                                           int position) {
  return current_->client().CompactFor(layer, session_id, position);
}

bool ReconnectingCacheRank::ServesPartialAttention(uint64_t session_id) const {
  return current_->client().ServesPartialAttention(session_id);
}

Result<OffloadPartial> ReconnectingCacheRank::PartialFor(int layer, uint64_t session_id,
                                                         int position) {
  return current_->client().PartialFor(layer, session_id, position);
}

Status ReconnectingCacheRank::RegisterMetrics(MetricsRegistry& registry) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Without a connection yet, the watcher registers the first one when it makes it.
  if (current_ != nullptr) RUBATO_RETURN_IF_ERROR(current_->RegisterMetrics(registry));
  RUBATO_ASSIGN_OR_RETURN(Gauge * link_up,
                          registry.AddGauge("rubato:cache_link_up",
                                            "1 while the cache rank answers heartbeats and the "
                                            "data plane works, else 0."));
  registry.AddCollector([this, link_up] { link_up->Set(Broken().ok() ? 1.0 : 0.0); });
  registry_ = &registry;
  return Status::Ok();
}

Result<rpc::StatsResponse> ReconnectingCacheRank::Stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (current_ == nullptr) return not_connected_;
  return current_->rpc().Stats();
}

int ReconnectingCacheRank::reconnects() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reconnects_;
}

void ReconnectingCacheRank::Watch() {
  int failed_attempts = 0;  // since the loss
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    // While the link works, or the engine still ends the lost link's requests (each closed
    // session wakes this thread), look again every backoff_.first.
    const bool link_ok = BrokenLocked().ok();
    if (link_ok || !open_sessions_.empty()) {
      if (link_ok) failed_attempts = 0;
      wake_.wait_for(lock, backoff_.first);
      continue;
    }
    // The first attempt at once, later ones after the backoff (a whole wait: only stopping
    // ends it early).
    const std::chrono::milliseconds delay = ReconnectDelay(backoff_, failed_attempts);
    if (delay.count() > 0 && wake_.wait_for(lock, delay, [this] { return stopping_; })) break;
    lock.unlock();
    Result<std::unique_ptr<RemoteCacheRank>> next = connect_(&abandon_);
    std::unique_ptr<RemoteCacheRank> old;
    lock.lock();
    if (stopping_) break;  // drops `next`, made or not
    if (!next.ok()) {
      ++failed_attempts;
      RUBATO_LOG_WARN("offload", "reconnecting to the cache rank: {}; next try in {} ms",
                      next.status().message(), ReconnectDelay(backoff_, failed_attempts).count());
      continue;
    }
    if (!open_sessions_.empty()) continue;  // drops `next`: try again
    if (registry_ != nullptr) {
      const Status registered = (*next)->RegisterMetrics(*registry_);
      if (!registered.ok()) RUBATO_LOG_WARN("offload", "{}", registered.message());
    }
    old = std::exchange(current_, std::move(next).value());
    if (old != nullptr) ++reconnects_;  // else the first connection, made late
    failed_attempts = 0;
    RUBATO_LOG_WARN("offload", "{} cache rank {}",
                    old != nullptr ? "reconnected to" : "connected to", current_->endpoint());
    lock.unlock();
    old.reset();  // joins the old connection's threads outside the lock
    lock.lock();
  }
}

}  // namespace rubato
