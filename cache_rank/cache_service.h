// The cache rank's service: sessions with their selector, and the data plane that serves them.
// Per connected inference rank ("peer"), a loop on the service's own thread receives KV packs,
// appends them to the KV store, asks the session's selector what the reply carries, gathers it
// into a reply pack and sends it back. The control plane calls OpenSession / CloseSession /
// PeerHealth / Stats from its own thread (the store is shared under one mutex). A failed pack
// stops that peer's data plane only; PeerHealth says why.
// Narrative: docs/disaggregated.md "The cache service".
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "cache_rank/kv_store.h"
#include "common/metrics.h"
#include "common/status.h"
#include "transport/compact_delta.h"
#include "transport/layer_pack.h"
#include "transport/transport.h"

namespace rubato {

struct CacheServiceOptions {
  uint64_t budget_bytes = uint64_t{1} << 30;    // KV storage all sessions may reserve
  uint64_t max_pack_bytes = uint64_t{4} << 30;  // a KV pack header announcing more is refused
  // What one peer (inference rank connection) may hold at once: bytes of its sessions (0: the
  // whole budget) and open sessions. A peer past either gets ResourceExhausted for the new
  // session; the other peers are unaffected.
  uint64_t peer_budget_bytes = 0;
  int max_sessions_per_peer = 4096;
  // Where sessions' KV lives: null is pageable host memory (kv_storage.h); pinned host memory
  // is MakePinnedKvStorageAllocator (CUDA builds).
  std::shared_ptr<KvStorageAllocator> allocator;
};

// What the data plane has done (the cache rank's metrics and Stats RPC).
struct CacheServiceStats {
  KvStoreStats store;
  uint64_t packs_received = 0;
  uint64_t bytes_received = 0;  // KV packs and their headers
  uint64_t replies_sent = 0;
  uint64_t replies_posted = 0;  // built and handed to the transport (sent once delivered)
  uint64_t bytes_sent = 0;
  uint64_t peers = 0;
  // Seconds the data plane spent selecting and building replies (attention on the cache rank
  // included), summed over the packs: the cache rank's share of an offloaded step.
  double selection_seconds = 0;
  // A predicting selector's counters (asyncspade), over every session it served.
  PredictionCounters predictions;
  // Where the KV lives: the storage allocator's name ("host", "pinned", ...); the store's bytes
  // are of that memory (a device store's are device bytes).
  std::string memory = "host";
};

class CacheService {
 public:
  explicit CacheService(const CacheServiceOptions& options);
  ~CacheService();  // Stop()

  CacheService(const CacheService&) = delete;
  CacheService& operator=(const CacheService&) = delete;

  // ---- control plane (any thread) ----
  // A session of `peer` for `request_id` whose replies `selector` picks (kInvalidArgument for an
  // unknown selector or a bad parameter): storage reserved by the store (kResourceExhausted
  // over budget), packs of `peer` only.
  Result<uint64_t> OpenSession(uint64_t peer, uint64_t request_id, const SessionShape& shape,
                               const CacheSelectorSpec& selector);
  Status CloseSession(uint64_t peer, uint64_t session_id);
  // Frees every session `peer` opened (its connection was lost) and drops its data plane.
  void ForgetPeer(uint64_t peer);
  // Ok while the peer's data plane works; else the error that stopped it. kNotFound for a peer
  // the service does not know.
  Status PeerHealth(uint64_t peer) const;
  CacheServiceStats Stats() const;
  // Registers and from then on updates (docs/design.md §3): rubato:cache_rank_sessions,
  // rubato:cache_rank_memory_bytes{kind="reserved"|"peak"|"budget"} (KV storage, of the
  // allocator's memory),
  // rubato:transport_bytes_total{role="cache", direction, backend} of the cache rank's data plane
  // and rubato:selection_latency_seconds{selector} (selecting and building one pack's reply).
  // `registry` must outlive the service.
  Status RegisterMetrics(MetricsRegistry& registry);

  // ---- data plane ----
  // Serves the KV packs `peer_rank` sends over `transport` from now on. The service drives the
  // transport from its thread; it is destroyed when the peer is forgotten or the service stops.
  Status AddPeer(uint64_t peer, std::unique_ptr<transport::Transport> transport, int peer_rank);
  // Starts the data-plane thread (idempotent); Stop joins it.
  void Start();
  void Stop();

 private:
  struct Peer;
  struct SessionInfo {
    uint64_t peer = 0;
    const CacheSelector* selector = nullptr;  // from the table, never null
    CacheSelectorSpec spec;
    uint64_t bytes = 0;  // what the session reserves (KvSessionBytes)
    // Delta replies: which position sits in which slot of the peer's compact pools,
    // [layer * num_kv_heads + kv_head]; made at the session's first delta pack.
    std::vector<CompactSlotMap> slot_maps;
    uint32_t pool_capacity = 0;  // slots per pool: the most reply rows the session can ask for
    std::unique_ptr<CacheSelectorState> state;  // the selector's (NewState), may be null
  };

  // The per-peer limits of a new session of `bytes` for `peer` (mutex_ held).
  Status CheckPeerLimits(uint64_t peer, uint64_t request_id, uint64_t bytes) const;
  void Run();
  // One step of a peer's receive / process / reply cycle; true when something happened.
  bool Progress(Peer& peer);
  // Processes the pack that arrived and posts its reply; the peer goes back to kIdle.
  Status ProcessAndReply(Peer& peer);
  Counter* TransportBytes(Peer& peer, bool sent);
  void CountReplySent(Peer& peer, uint64_t reply_bytes, bool delta);
  void CountReceived(Peer& peer, uint64_t bytes);
  // Appends a received KV pack and builds its reply into peer.reply.
  Status ProcessPack(Peer& peer);
  // The deltas of a delta KV pack's selections (one list of KV heads per (layer, request)),
  // from and into its sessions' slot maps.
  Result<std::vector<std::vector<CompactDelta>>> SelectionDeltas(
      const LayerPackView& pack, const std::vector<SessionInfo*>& sessions,
      const std::vector<KvHeadSelection>& selections);

  // The control plane's lock of mutex_ (RPC handler threads): announces itself so that the
  // data-plane thread, which sweeps its peers under mutex_ back to back, hands the mutex over
  // instead of re-taking it at once. Without the handoff a busy data plane on a loaded machine
  // starved a Health RPC for seconds (std::mutex is not fair).
  class ControlLock {
   public:
    explicit ControlLock(const CacheService& service);
    ~ControlLock() = default;

   private:
    std::unique_lock<std::mutex> lock_;
  };

  const CacheServiceOptions options_;
  mutable std::mutex mutex_;  // guards store_, sessions_, peers_ membership and peer health
  mutable std::atomic<int> control_waiting_{0};  // control-plane threads waiting for mutex_
  KvStore store_;
  std::map<uint64_t, SessionInfo> sessions_;         // by session id
  std::map<uint64_t, std::unique_ptr<Peer>> peers_;  // by peer id
  std::vector<uint64_t> forgotten_;                  // peers to drop on the service thread
  PredictionCounters closed_predictions_;            // of the sessions closed so far

  // Set by RegisterMetrics (under mutex_); updated where the numbers change.
  Gauge* sessions_metric_ = nullptr;
  Gauge* reserved_bytes_metric_ = nullptr;
  Gauge* peak_bytes_metric_ = nullptr;
  CounterFamily* transport_bytes_metric_ = nullptr;
  HistogramFamily* selection_metric_ = nullptr;
  void UpdateStoreGauges();  // with mutex_ held

  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::atomic<uint64_t> packs_received_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> replies_sent_{0};
  std::atomic<uint64_t> replies_posted_{0};
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> selection_nanoseconds_{0};
};

}  // namespace rubato
