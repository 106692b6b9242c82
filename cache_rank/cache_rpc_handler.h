// The cache rank's RPC handler (docs/design.md §3 "RPC control plane"): turns the control-plane
// calls of each inference-rank connection into CacheService calls. The connection id is the peer
// id: Hello connects that peer's data plane (a UCX endpoint pair whose addresses the Hello and its
// response carry, or an NCCL communicator of two whose unique id the Hello carries and which the
// handler joins as rank 0 on its GPU before answering; a Hello without a transport backend is a
// control-only peer), OpenSession / CloseSession act on its sessions, Health reports its data
// plane, and a lost connection frees its sessions.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "cache_rank/cache_service.h"
#include "transport/rpc/rpc_server.h"

namespace rubato {

struct CacheRpcHandlerOptions {
  int nccl_device = 0;  // the GPU of this rank's side of NCCL peers' communicators
  // How long a Hello waits for an NCCL peer's communicator to form (the peer's RPC deadline).
  std::chrono::milliseconds nccl_init_timeout{5000};
  // Whether the RPC server authenticates its peers (a token, transport/rpc/rpc_auth.h):
  // Shutdown is served only then; without a token any local process could stop the cache rank.
  bool peers_authenticated = false;
};

class CacheRpcHandler final : public rpc::RpcHandler {
 public:
  // `on_shutdown(reason)` runs when a peer asks the cache rank to stop (it must not stop the
  // RPC server from inside the call: signal the owner). `service` must outlive the handler.
  CacheRpcHandler(CacheService& service, std::function<void(const std::string&)> on_shutdown,
                  const CacheRpcHandlerOptions& options = {});

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

 private:
  // The data plane a Hello asks for ("ucx", "nccl"), connected, with what goes in the response.
  Result<std::unique_ptr<transport::Transport>> ConnectUcx(const rpc::HelloRequest& request,
                                                           rpc::HelloResponse& response);
  Result<std::unique_ptr<transport::Transport>> JoinNccl(const rpc::HelloRequest& request);

  CacheService& service_;
  std::function<void(const std::string&)> on_shutdown_;
  const CacheRpcHandlerOptions options_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

// The selector a session request names, with its numbers: no name is "dense", and the old name
// "topk" is "oracle_topk". Unchecked: CacheService::OpenSession refuses an unknown name.
CacheSelectorSpec SelectorSpecFromRequest(const rpc::OpenSessionRequest& request);

// The session shape an OpenSession request asks for (its dtype by name), every cache-rank
// handler's; InvalidArgument for an unknown dtype or a capacity past `max_capacity_tokens`.
Result<SessionShape> SessionShapeOf(const rpc::OpenSessionRequest& request,
                                    uint64_t max_capacity_tokens);

// The Shutdown RPC as every cache-rank handler serves it: refused unless the peers are
// authenticated (a token), else logged and handed to `stop` (may be empty).
Result<rpc::ShutdownResponse> ServeShutdown(bool peers_authenticated, rpc::ConnectionId connection,
                                            const rpc::ShutdownRequest& request,
                                            const std::function<void(const std::string&)>& stop);

}  // namespace rubato
