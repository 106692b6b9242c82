// The offloaded residency with its cache rank on a GPU of another process or thread, reached by
// the device data plane (device_plane_client.h): attention on the cache rank for dense over
// offloaded KV. Each request gets a session of the cache rank's device store at admission
// (DeviceSessionControl: the RPC, or the store itself in tests); the CUDA half sends every
// layer's q|k|v rows there and receives the decode rows' attention output, ordered by the
// model's stream alone, so that over NCCL its decode steps replay as CUDA graphs. A cache rank
// that is lost ends the requests in flight with its error (Broken). Dense only: a policy with a
// cache-rank selector of its own is refused by name. docs/disaggregated.md "A GPU cache rank in
// its own process".
#pragma once

#include <cstdint>
#include <memory>
#include <string>

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
};

class DeviceCacheRankResidency final : public Residency {
 public:
  // `client` (on the model's GPU) and `control` outlive the residency; `cache_name` names the
  // cache rank in errors ("cache rank 10.0.0.2:7000").
  DeviceCacheRankResidency(DevicePlaneClient& client, DeviceSessionControl& control,
                           std::string cache_name);

  std::string_view name() const override { return "offloaded"; }
  KvResidency kind() const override { return KvResidency::kOffloaded; }

  Status Check(const AttentionPolicy* policy) const override;
  // Installs the CUDA half; Unsupported on another model, InvalidArgument when max_batch
  // exceeds the data plane's max_runs.
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  Status Close(ResidencyRequest& request) override;
  Status Broken() const override { return control_.Health(); }

  Status RegisterMetrics(MetricsRegistry& registry) override;
  // " cache_bytes_out=... cache_bytes_back=...".
  std::string StatsLine() const override;

 private:
  DevicePlaneClient& client_;
  DeviceSessionControl& control_;
  const std::string cache_name_;
  Counter* bytes_out_metric_ = nullptr;
  Counter* bytes_back_metric_ = nullptr;
  uint64_t counted_out_ = 0;  // of the client's totals, already in the metrics
  uint64_t counted_back_ = 0;
  friend class DeviceCacheRankBackend;
  void CountSteps();
};

}  // namespace rubato
