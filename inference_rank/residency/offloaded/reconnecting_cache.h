// A cache rank that comes back: ReconnectingCacheRank is the engine's KvOffloadClient for a
// remote cache rank, forwarding to the current RemoteCacheRank and replacing it when it is lost.
// The loss shows at once in Broken() (the data plane's error, or the heartbeat's); requests in
// flight then fail with that one error. A watcher thread reconnects once no session is open any
// more (the engine has failed every request of the lost rank): at once, then with exponential
// backoff (ReconnectDelay), after which Broken() is ok and new requests open sessions on the new
// connection. Destroying it gives up an attempt in progress at once (a stalled cache rank does
// not hold up the process's exit).
// Narrative: docs/disaggregated.md "Reconnecting".
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <thread>

#include "common/metrics.h"
#include "common/status.h"
#include "inference_rank/residency/offloaded/kv_offload.h"
#include "inference_rank/residency/offloaded/reconnect_backoff.h"
#include "inference_rank/residency/offloaded/remote_cache.h"

namespace rubato {

class ReconnectingCacheRank final : public KvOffloadClient {
 public:
  // Makes one connection; gives up at once when *abandon turns true (RemoteCacheRank::Connect).
  using Connector =
      std::function<Result<std::unique_ptr<RemoteCacheRank>>(const std::atomic<bool>* abandon)>;

  // Connects once through `connect` (its error is returned as is) and starts the watcher.
  static Result<std::unique_ptr<ReconnectingCacheRank>> Connect(Connector connect,
                                                                ReconnectBackoff backoff);
  // Starts without a connection, `why` the first attempt's error: Broken() says so until the
  // watcher connects (at once, then with the backoff). For one of several cache ranks that is
  // not up yet when the inference rank starts (MultiCacheRank places requests on the others).
  static std::unique_ptr<ReconnectingCacheRank> StartDisconnected(Connector connect,
                                                                  ReconnectBackoff backoff,
                                                                  Status why);
  // Gives up a reconnect attempt in progress, stops the watcher, then drops the connection.
  ~ReconnectingCacheRank() override;
  ReconnectingCacheRank(const ReconnectingCacheRank&) = delete;
  ReconnectingCacheRank& operator=(const ReconnectingCacheRank&) = delete;

  Result<uint64_t> OpenSession(uint64_t request_id, int capacity_tokens) override;
  Status CloseSession(uint64_t session_id) override;
  // The current connection's data-plane error, else its heartbeat's, else ok.
  Status Broken() const override;
  // The data plane; only called for open sessions, so never during a swap (no lock).
  Status LayerComputed(int layer, std::span<const OffloadLayerKv> entries) override;
  Result<OffloadCompactKv> CompactFor(int layer, uint64_t session_id, int position) override;
  bool ServesPartialAttention(uint64_t session_id) const override;
  Result<OffloadPartial> PartialFor(int layer, uint64_t session_id, int position) override;

  // RemoteCacheRank::RegisterMetrics for every connection (the same children carry on), and
  // rubato:cache_link_up (1 while Broken() is ok), read at each scrape. `registry` must not be
  // scraped after this is destroyed.
  Status RegisterMetrics(MetricsRegistry& registry);
  // The current connection's Stats RPC (free budget for placement: multi_cache.h).
  Result<rpc::StatsResponse> Stats();
  int reconnects() const;  // connections made after the first
  // The current connection, null while none was ever made: for its byte counts once the engine
  // is done (not while a reconnect may replace it).
  RemoteCacheRank* current() { return current_.get(); }

 private:
  ReconnectingCacheRank() = default;
  Status BrokenLocked() const;
  void Watch();

  Connector connect_;
  ReconnectBackoff backoff_;
  // Set by the destructor: an attempt in progress gives up. Declared before current_, whose
  // RPC client reads it, so that it outlives it.
  std::atomic<bool> abandon_{false};
  mutable std::mutex mutex_;  // guards the fields below
  std::condition_variable wake_;
  std::unique_ptr<RemoteCacheRank> current_;  // null until the first connection is made
  Status not_connected_;                      // why, while current_ is null
  std::set<uint64_t> open_sessions_;
  MetricsRegistry* registry_ = nullptr;
  int reconnects_ = 0;
  bool stopping_ = false;
  std::thread watcher_;
};

}  // namespace rubato
