// A cache rank in another process: the RPC client to its endpoint, the data plane the Hello
// connects (UCX worker addresses, or an NCCL communicator with host packs staged through device
// memory), and the CacheRankClient the engine offloads through; what `rubato generate --cache
// HOST:PORT` and an mpirun inference rank use. A lost cache rank (connection dropped, or
// heartbeats unanswered for limits.heartbeat_ms * 5) ends the client's waits with kUnavailable;
// a new RemoteCacheRank reconnects (ReconnectingCacheRank does: reconnecting_cache.h).
// Usage: docs/disaggregated.md "The remote cache rank".
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "common/config.h"
#include "common/hf_config.h"
#include "common/metrics.h"
#include "common/status.h"
#include "inference_rank/residency/offloaded/cache_client.h"
#include "transport/rpc/rpc_client.h"

namespace rubato {

// Which data plane reaches the cache rank.
struct RemoteDataPlane {
  TopologySection::Transport backend = TopologySection::Transport::kUcx;  // ucx or nccl
  int device = 0;  // nccl: this rank's GPU (the cache rank's must be another)
};

class RemoteCacheRank {
 public:
  // Connects the control plane (within limits.rpc_timeout_ms), says Hello with the model's
  // shape and what connects `data_plane` (an NCCL communicator must also form within
  // limits.rpc_timeout_ms). kUnsupported when this build lacks the backend. Once `*abandon`
  // (when given; it must outlive the result) turns true, the attempt and the connection's
  // control calls give up at once (rpc::RpcClientOptions::abandon).
  static Result<std::unique_ptr<RemoteCacheRank>> Connect(
      const std::string& endpoint, const ModelConfig& model,
      const CacheClientOptions& client_options, const LimitsSection& limits,
      const RemoteDataPlane& data_plane = {}, const std::atomic<bool>* abandon = nullptr);
  ~RemoteCacheRank();

  // The client's metrics (CacheRankClient::RegisterMetrics) and the control plane's:
  // rubato:cache_rpc_latency_seconds and rubato:cache_rpc_errors_total (sessions and health
  // calls). A later connection registering again carries on the same children.
  Status RegisterMetrics(MetricsRegistry& registry);

  CacheRankClient& client() { return *client_; }
  rpc::RpcClient& rpc() { return *rpc_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  class RpcSessionControl;
  RemoteCacheRank() = default;

  std::string endpoint_;
  std::unique_ptr<rpc::RpcClient> rpc_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<RpcSessionControl> control_;
  std::unique_ptr<CacheRankClient> client_;
};

}  // namespace rubato
