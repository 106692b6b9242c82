// ReconnectingCacheRank (reconnecting_cache.h): forwarding, loss detection and the watcher.
#include "inference_rank/residency/offloaded/reconnecting_cache.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"

namespace rubato {

Result<std::unique_ptr<ReconnectingCacheRank>> ReconnectingCacheRank::Connect(
    Connector connect, ReconnectBackoff backoff) {
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<RemoteCacheRank> first, connect());
  std::unique_ptr<ReconnectingCacheRank> cache(new ReconnectingCacheRank());
  cache->connect_ = std::move(connect);
  cache->backoff_ = backoff;
  cache->current_ = std::move(first);
  cache->watcher_ = std::thread([raw = cache.get()] { raw->Watch(); });
  return cache;
}

ReconnectingCacheRank::~ReconnectingCacheRank() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

Status ReconnectingCacheRank::BrokenLocked() const {
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
    closed = current_->client().CloseSession(session_id);
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
  RUBATO_RETURN_IF_ERROR(current_->RegisterMetrics(registry));
  RUBATO_ASSIGN_OR_RETURN(Gauge * link_up,
                          registry.AddGauge("rubato:cache_link_up",
                                            "1 while the cache rank answers heartbeats and the "
                                            "data plane works, else 0."));
  registry.AddCollector([this, link_up] { link_up->Set(Broken().ok() ? 1.0 : 0.0); });
  registry_ = &registry;
  return Status::Ok();
}

int ReconnectingCacheRank::reconnects() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reconnects_;
}

void ReconnectingCacheRank::Watch() {
  std::chrono::milliseconds wait = backoff_.first;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    // Idle while the link works; after a loss, the engine's requests on it end first (their
    // sessions close), then one attempt per backoff period.
    wake_.wait_for(lock, BrokenLocked().ok() ? backoff_.first : wait);
    if (stopping_) break;
    if (BrokenLocked().ok()) {
      wait = backoff_.first;
      continue;
    }
    if (!open_sessions_.empty()) continue;
    lock.unlock();
    Result<std::unique_ptr<RemoteCacheRank>> next = connect_();
    std::unique_ptr<RemoteCacheRank> old;
    lock.lock();
    if (!next.ok()) {
      RUBATO_LOG_WARN("offload", "reconnecting to the cache rank: {}; next try in {} ms",
                      next.status().message(), (wait * 2).count());
      wait = std::min(wait * 2, backoff_.max);
      continue;
    }
    if (!open_sessions_.empty() || stopping_) continue;  // drops `next`: try again later
    if (registry_ != nullptr) {
      const Status registered = (*next)->RegisterMetrics(*registry_);
      if (!registered.ok()) RUBATO_LOG_WARN("offload", "{}", registered.message());
    }
    old = std::exchange(current_, std::move(next).value());
    ++reconnects_;
    wait = backoff_.first;
    RUBATO_LOG_WARN("offload", "reconnected to cache rank {}", current_->endpoint());
    lock.unlock();
    old.reset();  // joins the old connection's threads outside the lock
    lock.lock();
  }
}

}  // namespace rubato
