// A cache rank in another process (DESIGN §1 "Disaggregated mode"): the RPC client to its
// endpoint, the data plane the Hello connects (UCX: the Hello swaps worker addresses; NCCL: it
// carries the communicator's unique id, both ranks join while it is answered, and host packs are
// staged through device memory), and the CacheRankClient the engine offloads through. What `rubato generate --cache HOST:PORT` and the inference rank of an
// mpirun launch use.
//
//   RUBATO_ASSIGN_OR_RETURN(auto cache, RemoteCacheRank::Connect("10.0.0.2:7000", model.config(),
//                                                                 client_options, limits));
//   engine_options.offload = &cache->client();
//
// The cache rank is lost (SIGKILL: the TCP connection drops; SIGSTOP: heartbeats go unanswered)
// within limits.heartbeat_ms * 5 (+ one heartbeat): the client's waits end with kUnavailable and
// the engine fails the offloaded requests. A new RemoteCacheRank reconnects (e.g. to a
// restarted cache rank).
#pragma once

#include <memory>
#include <string>

#include "common/config.h"
#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/offload/cache_client.h"
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
  // limits.rpc_timeout_ms). kUnsupported when this build lacks the backend.
  static Result<std::unique_ptr<RemoteCacheRank>> Connect(const std::string& endpoint,
                                                          const ModelConfig& model,
                                                          const CacheClientOptions& client_options,
                                                          const LimitsSection& limits,
                                                          const RemoteDataPlane& data_plane = {});
  ~RemoteCacheRank();

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
