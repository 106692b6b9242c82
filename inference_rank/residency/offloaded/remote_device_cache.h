// A GPU cache rank in another process (`rubato cache --memory device`, or the mpirun cache role
// with `cache.memory: device`) reached by the device data plane: the RPC client to its
// endpoint, the NCCL communicator its Hello forms (device memory, no host staging), the
// DevicePlaneClient on the model's GPU, sessions over the RPC, and a watchdog that learns of a
// lost cache rank from the heartbeat or the Health call and aborts the communicator, so that
// the model's stream, waiting inside an NCCL receive, runs on and the step fails with that
// error (DeviceCacheRankResidency::FinishStep). A lost one is replaced by a new connection to
// its endpoint once its requests have ended (DeviceCacheRankResidency's watcher; with several,
// the others serve on meanwhile).
// docs/disaggregated.md "A GPU cache rank in its own process", "Several GPU cache ranks".
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/config.h"
#include "common/hf_config.h"
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"
#include "transport/nccl_transport.h"
#include "transport/rpc/rpc_client.h"

namespace rubato {

class RemoteDeviceCacheRank final : public DeviceSessionControl {
 public:
  // Connects (within limits.rpc_timeout_ms), says Hello with the model's shape, a new NCCL
  // unique id and `plane`'s limits, and joins the communicator on `device` while the cache rank
  // does on its GPU. A null result (not an error): the cache rank keeps the KV in host memory
  // (its response has no cache_memory "device"); connect for layer packs instead. Once
  // `*abandon` is true the connect and the Hello give up at once, and so does the join with
  // them (rpc::RpcClientOptions::abandon; it must outlive the connection).
  static Result<std::unique_ptr<RemoteDeviceCacheRank>> Connect(
      const std::string& endpoint, const ModelConfig& model, const LimitsSection& limits,
      int device, const DevicePlaneLimits& plane, const std::atomic<bool>* abandon = nullptr);
  ~RemoteDeviceCacheRank() override;

  DevicePlaneClient& client() { return *client_; }
  const std::string& name() const { return name_; }

  Result<uint64_t> OpenSession(uint64_t request_id, int capacity_tokens) override;
  Status CloseSession(uint64_t session_id) override;
  // Its budget less what open sessions reserve (its Stats RPC).
  Result<uint64_t> FreeBytes() override;
  // The loss the watchdog saw, or ok.
  Status Health() override;

 private:
  RemoteDeviceCacheRank() = default;
  void Watch(std::chrono::milliseconds period);

  std::string name_;  // "cache rank HOST:PORT"
  ModelConfig model_;
  std::unique_ptr<rpc::RpcClient> rpc_;
  std::unique_ptr<transport::NcclTransport> transport_;
  std::unique_ptr<DevicePlaneClient> client_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;  // under mutex_
  Status lost_;            // under mutex_
  std::thread watchdog_;
};

// What the residency table's factory uses for topology.mode disaggregated, topology.transport
// nccl and the CUDA engine with dense attention: the offloaded residency over the cache ranks of
// topology.cache_endpoints (each answering now; each reconnected when lost) when they keep the
// KV on their GPUs, or null when the first keeps it in host memory; cache ranks that disagree
// are refused by name.
Result<std::shared_ptr<Residency>> ConnectDeviceCacheRank(const RubatoConfig& config,
                                                          const ModelConfig& model);

}  // namespace rubato
