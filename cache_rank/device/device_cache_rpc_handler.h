// The RPC handler of a cache rank that keeps the KV on its GPU (`rubato cache --memory device`,
// the mpirun cache role with `cache.memory: device`): attention on the cache rank for dense over
// offloaded KV, served by the device data plane. The first Hello fixes the model shape and
// makes the DeviceKvStore on the GPU (the budget's blocks, zeroed); each connection's Hello
// joins an NCCL communicator of two (its unique id in the Hello) on that GPU, device memory
// only, and starts a DeviceAttentionServer for the peer on a thread of its own with the limits
// the Hello offers; the response says cache_memory "device". OpenSession / CloseSession act on
// the store (selector "attention", bf16; the budget named when it is full), Health reports the
// peer's loop, a lost connection stops its loop (aborting its communicator) and frees its
// sessions. docs/disaggregated.md "A GPU cache rank in its own process".
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cache_rank/device/device_kv_store.h"
#include "transport/rpc/rpc_server.h"

namespace rubato {

struct DeviceCacheRpcHandlerOptions {
  int device = 0;             // the cache rank's GPU (store, loops, communicators)
  uint64_t budget_bytes = 0;  // K and V of every session, > 0
  std::string budget_name = "cache.budget_gib";  // the setting named in refusals
  int block_tokens = 16;
  // How long a Hello waits for its peer's communicator to form (the peer's RPC deadline).
  std::chrono::milliseconds nccl_init_timeout{5000};
  bool peers_authenticated = false;  // Shutdown is served only then (cache_rpc_handler.h)
};

class DeviceCacheRpcHandler final : public rpc::RpcHandler {
 public:
  DeviceCacheRpcHandler(std::function<void(const std::string&)> on_shutdown,
                        const DeviceCacheRpcHandlerOptions& options);
  ~DeviceCacheRpcHandler() override;  // stops every peer's loop

  // Whether `device` is a GPU this process can use (checked before listening: the store is
  // made at the first Hello). Unavailable naming the device and the count.
  static Status CheckDevice(int device);

  Result<rpc::HelloResponse> OnHello(rpc::ConnectionId connection,
                                     const rpc::HelloRequest& request) override;
  Result<rpc::OpenSessionResponse> OnOpenSession(rpc::ConnectionId connection,
                                                 const rpc::OpenSessionRequest& request) override;
  Result<rpc::CloseSessionResponse> OnCloseSession(
      rpc::ConnectionId connection, const rpc::CloseSessionRequest& request) override;
  Result<rpc::StatsResponse> OnStats(rpc::ConnectionId connection,
                                     const rpc::StatsRequest& request) override;
  Result<rpc::HealthResponse> OnHealth(rpc::ConnectionId connection,
                                       const rpc::HealthRequest& request) override;
  Result<rpc::ShutdownResponse> OnShutdown(rpc::ConnectionId connection,
                                           const rpc::ShutdownRequest& request) override;
  void OnConnectionLost(rpc::ConnectionId connection, const Status& reason) override;

  // Steps served and bytes each way over every peer so far (the stop line).
  struct Totals {
    uint64_t steps = 0;
    uint64_t bytes_received = 0;
    uint64_t bytes_sent = 0;
  };
  Totals totals() const;

 private:
  struct Peer;
  Status EnsureStore(const rpc::ModelShape& shape);
  // Stops `peer`'s loop, frees its sessions and adds its counters to the totals.
  void RetirePeer(Peer& peer);

  std::function<void(const std::string&)> on_shutdown_;
  const DeviceCacheRpcHandlerOptions options_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  mutable std::mutex mutex_;  // peers_, totals_, store_ creation
  std::map<rpc::ConnectionId, std::unique_ptr<Peer>> peers_;
  Totals totals_;
  std::mutex store_mutex_;  // the store's calls (the loops plan steps under it)
  std::unique_ptr<DeviceKvStore> store_;
};

}  // namespace rubato
