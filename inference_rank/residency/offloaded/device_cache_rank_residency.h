// The offloaded residency with its cache ranks on GPUs of other processes or threads, reached
// by the device data plane (device_plane_client.h): attention on the cache ranks for dense over
// offloaded KV. Each request gets a session of one cache rank's device store at admission
// (DeviceSessionControl: the RPC, or the store itself in tests), on the rank with the most free
// budget when there are several; the CUDA half sends every layer's q|k|v rows to their ranks
// and receives the decode rows' attention, ordered by the model's stream alone, so that over
// NCCL its decode steps replay as CUDA graphs. With one cache rank its loss ends every request
// (Broken); with several only the lost rank's (RequestBroken). A rank given a connector is
// connected again once none of its requests is open (a watcher thread, with backoff) and takes
// new requests. Dense only: a policy with a cache-rank selector of its own is refused by name.
// docs/disaggregated.md "A GPU cache rank in its own process", "Several GPU cache ranks".
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "inference_rank/residency/offloaded/device_plane_client.h"
#include "inference_rank/residency/offloaded/reconnect_backoff.h"
#include "inference_rank/residency/residency.h"

namespace rubato {

// Sessions of a GPU cache rank (its device store's), and its health.
class DeviceSessionControl {
 public:
  virtual ~DeviceSessionControl() = default;
  // A session of positions [0, capacity_tokens), its blocks reserved now; ResourceExhausted
  // naming the cache rank's budget when they are not free.
  virtual Result<uint64_t> OpenSession(uint64_t request_id, int capacity_tokens) = 0;
  virtual Status CloseSession(uint64_t session_id) = 0;
  // The error that stopped the cache rank or its data plane, or ok (cheap: called every step;
  // from any thread).
  virtual Status Health() = 0;
  // Bytes of its budget no session holds (placement over several cache ranks; not called with
  // one).
  virtual Result<uint64_t> FreeBytes() = 0;
};

// A connection to a GPU cache rank: its sessions and health, owning whatever its data plane
// (`client`, on the model's GPU) needs.
struct DeviceCacheRankConnection {
  std::unique_ptr<DeviceSessionControl> control;
  DevicePlaneClient* client = nullptr;  // into `control`'s connection; null in CPU tests
};

// Connects to a lost cache rank's endpoint again (the control RPC and a new device data plane,
// what the first connect made); gives up at once when *abandon turns true. Called on the
// residency's watcher thread.
using DeviceCacheRankConnector =
    std::function<Result<DeviceCacheRankConnection>(const std::atomic<bool>* abandon)>;

// One cache rank of the residency: `client` (on the model's GPU) and `control` outlive it, or
// `owned` holds `control` (and what `client` points into).
struct DeviceCacheRankPeer {
  DevicePlaneClient* client = nullptr;
  DeviceSessionControl* control = nullptr;
  std::string name;  // names the rank in errors ("cache rank 10.0.0.2:7000")
  std::unique_ptr<DeviceSessionControl> owned = nullptr;
  // Set: once the rank is lost and none of its requests is open, a new connection replaces it
  // (the watcher's); null: a lost rank stays lost.
  DeviceCacheRankConnector reconnect = nullptr;
};

class DeviceCacheRankResidency final : public Residency {
 public:
  // One cache rank: `client` (on the model's GPU) and `control` outlive the residency;
  // `cache_name` names it in errors ("cache rank 10.0.0.2:7000").
  DeviceCacheRankResidency(DevicePlaneClient& client, DeviceSessionControl& control,
                           std::string cache_name);
  // One or more cache ranks (none is refused at Attach); every client's limits equal. Ranks
  // with a connector are connected again after a loss: at once, then waiting `backoff`
  // (ReconnectDelay) between failed attempts.
  explicit DeviceCacheRankResidency(std::vector<DeviceCacheRankPeer> ranks,
                                    ReconnectBackoff backoff = {});
  // Gives up a reconnect attempt in progress and stops the watcher, then drops the connections.
  ~DeviceCacheRankResidency() override;
  DeviceCacheRankResidency(const DeviceCacheRankResidency&) = delete;
  DeviceCacheRankResidency& operator=(const DeviceCacheRankResidency&) = delete;

  std::string_view name() const override { return "offloaded"; }
  KvResidency kind() const override { return KvResidency::kOffloaded; }

  Status Check(const AttentionPolicy* policy) const override;
  // Installs the CUDA half; Unsupported on another model, InvalidArgument when max_batch
  // exceeds the data plane's max_runs.
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  // Places the request (after installing the connections the watcher made since the last
  // admission: a reconnected rank takes requests from here on).
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  Status Close(ResidencyRequest& request) override;
  // One rank: its loss. Several: an error only when every rank is lost. From any thread.
  Status Broken() const override;
  // The loss of the rank holding `request`'s session (or of the transfers to it), or ok.
  Status RequestBroken(const ResidencyRequest& request) const override;

  // rubato:transport_bytes_total (device), and rubato:cache_link_up (1 while Broken() is ok,
  // read at each scrape).
  Status RegisterMetrics(MetricsRegistry& registry) override;
  // " cache_bytes_out=... cache_bytes_back=...".
  std::string StatsLine() const override;
  // Connections the watcher made to lost ranks.
  int reconnects() const;

 private:
  friend class DeviceCacheRankBackend;
  friend class DeviceCacheRanksBackend;
  void CountSteps();
  Status RankLost(int rank) const;  // RankLostLocked under mutex_
  // Its control's health, else its failed transfer; ok once a new connection waits for it.
  Status RankLostLocked(size_t rank) const;
  void MarkFailed(int rank, const Status& why);
  uint64_t TotalBytesOut() const;
  uint64_t TotalBytesBack() const;
  // What a captured step holds of rank `rank`: its rows and decode rows, and its connection (a
  // graph holds the communicator it sends to: one of a lost connection is never replayed).
  int64_t GraphKeySlot(size_t rank, int64_t rows, int64_t decode_rows) const;
  // Reconnecting (device_cache_rank_reconnect.cc): the engine's thread swaps in what the
  // watcher made, between steps; the watcher connects lost ranks none of whose requests is
  // open and drops the connections swapped out.
  void InstallReconnected();
  void Watch();

  // Set by the destructor: an attempt in progress gives up. Declared before the connections
  // (ranks_, ready_, retired_), whose RPC clients read it, so that it outlives them.
  std::atomic<bool> abandon_{false};
  // Written on the engine's thread only, under mutex_ (InstallReconnected); read there without
  // it, and under it elsewhere (the watcher, a metrics scrape).
  std::vector<DeviceCacheRankPeer> ranks_;
  const ReconnectBackoff backoff_;
  Counter* bytes_out_metric_ = nullptr;
  Counter* bytes_back_metric_ = nullptr;
  uint64_t counted_out_ = 0;  // of the clients' totals, already in the metrics
  uint64_t counted_back_ = 0;
  uint64_t retired_out_ = 0;  // the totals of clients swapped out
  uint64_t retired_back_ = 0;
  std::vector<int> generation_;  // [rank] connections swapped in (engine thread: graph keys)
  mutable std::mutex mutex_;     // guards the fields below
  std::condition_variable wake_;
  std::vector<Status> failed_;  // [rank] a transfer to it that failed in a step (several ranks)
  std::vector<int> open_;       // [rank] sessions open
  std::vector<std::optional<DeviceCacheRankConnection>> ready_;  // [rank] made, not swapped in
  std::vector<std::unique_ptr<DeviceSessionControl>> retired_;   // swapped out, to drop
  int reconnects_ = 0;
  bool stopping_ = false;
  std::thread watcher_;  // only with a connector
};

}  // namespace rubato
