// The offloaded residency with its cache ranks on GPUs of other processes or threads, reached
// by the device data plane (device_plane_client.h): attention on the cache ranks for dense over
// offloaded KV. Each request gets a session of one cache rank's device store at admission
// (DeviceSessionControl: the RPC, or the store itself in tests), on the rank with the most free
// budget when there are several; the CUDA half sends every layer's q|k|v rows to their ranks
// and receives the decode rows' attention, ordered by the model's stream alone, so that over
// NCCL its decode steps replay as CUDA graphs. With one cache rank its loss ends every request
// (Broken); with several only the lost rank's (RequestBroken). Dense only: a policy with a
// cache-rank selector of its own is refused by name. docs/disaggregated.md "A GPU cache rank in
// its own process", "Several GPU cache ranks".
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "inference_rank/residency/offloaded/device_plane_client.h"
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
  // The error that stopped the cache rank or its data plane, or ok (cheap: called every step).
  virtual Status Health() = 0;
  // Bytes of its budget no session holds (placement over several cache ranks; not called with
  // one).
  virtual Result<uint64_t> FreeBytes() = 0;
};

// One cache rank of the residency; `client` (on the model's GPU) and `control` outlive it.
struct DeviceCacheRankPeer {
  DevicePlaneClient* client = nullptr;
  DeviceSessionControl* control = nullptr;
  std::string name;  // names the rank in errors ("cache rank 10.0.0.2:7000")
};

class DeviceCacheRankResidency final : public Residency {
 public:
  // One cache rank: `client` (on the model's GPU) and `control` outlive the residency;
  // `cache_name` names it in errors ("cache rank 10.0.0.2:7000").
  DeviceCacheRankResidency(DevicePlaneClient& client, DeviceSessionControl& control,
                           std::string cache_name);
  // One or more cache ranks (none is refused at Attach); every client's limits equal.
  explicit DeviceCacheRankResidency(std::vector<DeviceCacheRankPeer> ranks);

  std::string_view name() const override { return "offloaded"; }
  KvResidency kind() const override { return KvResidency::kOffloaded; }

  Status Check(const AttentionPolicy* policy) const override;
  // Installs the CUDA half; Unsupported on another model, InvalidArgument when max_batch
  // exceeds the data plane's max_runs.
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  Status Close(ResidencyRequest& request) override;
  // One rank: its loss. Several: an error only when every rank is lost.
  Status Broken() const override;
  // The loss of the rank holding `request`'s session (or of the transfers to it), or ok.
  Status RequestBroken(const ResidencyRequest& request) const override;

  Status RegisterMetrics(MetricsRegistry& registry) override;
  // " cache_bytes_out=... cache_bytes_back=...".
  std::string StatsLine() const override;

 private:
  std::vector<DeviceCacheRankPeer> ranks_;
  Counter* bytes_out_metric_ = nullptr;
  Counter* bytes_back_metric_ = nullptr;
  uint64_t counted_out_ = 0;  // of the clients' totals, already in the metrics
  uint64_t counted_back_ = 0;
  // [rank] a transfer to it that failed in a step (the CUDA half's, several ranks only).
  mutable std::mutex mutex_;
  std::vector<Status> failed_;
  friend class DeviceCacheRankBackend;
  friend class DeviceCacheRanksBackend;
  void CountSteps();
  Status RankLost(int rank) const;  // its control's health, else its failed transfer
  void MarkFailed(int rank, const Status& why);
  uint64_t TotalBytesOut() const;
  uint64_t TotalBytesBack() const;
};

}  // namespace rubato
