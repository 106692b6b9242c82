// CacheRpcHandler (cache_rpc_handler.h).
#include "cache_rank/cache_rpc_handler.h"

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>

#include "common/dtype.h"
#include "common/logging.h"

#ifdef RUBATO_HAS_UCX
#include "transport/ucx_transport.h"
#endif
#ifdef RUBATO_HAS_NCCL
#include "transport/nccl_host_staging.h"
#endif

namespace rubato {
namespace {

constexpr const char* kLogSubsystem = "cache";

}  // namespace

CacheSelectorSpec SelectorSpecFromRequest(const rpc::OpenSessionRequest& request) {
  CacheSelectorSpec spec;
  // Peers that never set the field want the whole-prefix replies of the retired "dense"
  // selector, refused by that name; "topk" is oracle_topk's name on older peers.
  spec.name = request.selector().empty() ? "dense" : request.selector();
  if (spec.name == "topk") spec.name = "oracle_topk";
  spec.top_k = static_cast<int>(std::min<uint32_t>(request.top_k(), INT32_MAX));
  spec.sink_tokens = static_cast<int>(std::min<uint32_t>(request.sink_tokens(), INT32_MAX));
  spec.recent_tokens = static_cast<int>(std::min<uint32_t>(request.recent_tokens(), INT32_MAX));
  spec.query_window = static_cast<int>(std::min<uint32_t>(request.query_window(), INT32_MAX));
  spec.ridge_lambda = request.ridge_lambda();
  spec.dense_steps = static_cast<int>(std::min<uint32_t>(request.dense_steps(), INT32_MAX));
  spec.overlap_every = static_cast<int>(std::min<uint32_t>(request.overlap_every(), INT32_MAX));
  return spec;
}

CacheRpcHandler::CacheRpcHandler(CacheService& service,
                                 std::function<void(const std::string&)> on_shutdown,
                                 const CacheRpcHandlerOptions& options)
    : service_(service), on_shutdown_(std::move(on_shutdown)), options_(options) {}

Result<rpc::HelloResponse> CacheRpcHandler::OnHello(rpc::ConnectionId connection,
                                                    const rpc::HelloRequest& request) {
  // A control-only peer (stats, health, shutdown) connects no data plane.
  if (request.transport_backend().empty()) return rpc::HelloResponse();
  rpc::HelloResponse response;
  Result<std::unique_ptr<transport::Transport>> transport =
      request.transport_backend() == "ucx" ? ConnectUcx(request, response)
      : request.transport_backend() == "nccl"
          ? JoinNccl(request)
          : UnsupportedError("hello: data-plane backend '" + request.transport_backend() +
                             "' is not one of ucx, nccl");
  if (!transport.ok()) return transport.status();
  response.set_transport_backend(request.transport_backend());
  RUBATO_RETURN_IF_ERROR(service_.AddPeer(connection, std::move(transport).value(), 1));
  RUBATO_LOG_INFO(kLogSubsystem, "peer {} (rank {}) connected its {} data plane", connection,
                  request.rank(), request.transport_backend());
  return response;
}

// A world of two per connection: the cache rank is rank 0, the inference rank rank 1.
Result<std::unique_ptr<transport::Transport>> CacheRpcHandler::ConnectUcx(
    const rpc::HelloRequest& request, rpc::HelloResponse& response) {
#ifdef RUBATO_HAS_UCX
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<transport::UcxTransport> ucx,
                          transport::UcxTransport::Create(0, 2));
  const std::string& peer_address = request.transport_address();
  RUBATO_RETURN_IF_ERROR(ucx->Connect(
      1, std::span<const std::byte>(reinterpret_cast<const std::byte*>(peer_address.data()),
                                    peer_address.size())));
  const std::span<const std::byte> mine = ucx->LocalAddress();
  response.set_transport_address(
      std::string(reinterpret_cast<const char*>(mine.data()), mine.size()));
  return std::unique_ptr<transport::Transport>(std::move(ucx));
#else
  (void)request;
  (void)response;
  return UnsupportedError("hello: this cache rank was built without UCX (RUBATO_UCX)");
#endif
}

// The Hello carries the communicator's unique id; the inference rank joins as rank 1 while this
// call joins as rank 0 (both return once the pair exchanged a byte).
Result<std::unique_ptr<transport::Transport>> CacheRpcHandler::JoinNccl(
    const rpc::HelloRequest& request) {
#ifdef RUBATO_HAS_NCCL
  Result<std::unique_ptr<transport::NcclTransport>> joined =
      transport::NcclTransport::Create({.unique_id = request.transport_address(),
                                        .rank = 0,
                                        .world_size = 2,
                                        .device = options_.nccl_device,
                                        .init_timeout = options_.nccl_init_timeout});
  if (!joined.ok()) {
    return joined.status().WithContext("hello: joining the peer's NCCL communicator on GPU " +
                                       std::to_string(options_.nccl_device) +
                                       " (`rubato cache --device`; each rank needs its own GPU)");
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<transport::NcclHostStagingTransport> staged,
                          transport::NcclHostStagingTransport::Create(std::move(joined).value()));
  return std::unique_ptr<transport::Transport>(std::move(staged));
#else
  (void)request;
  return UnsupportedError("hello: this cache rank was built without NCCL (a CUDA build finds it)");
#endif
}

Result<SessionShape> SessionShapeOf(const rpc::OpenSessionRequest& request,
                                    uint64_t max_capacity_tokens) {
  SessionShape shape;
  shape.num_layers = request.num_layers();
  shape.num_kv_heads = request.num_kv_heads();
  shape.num_query_heads = request.num_query_heads();
  shape.head_dim = request.head_dim();
  RUBATO_ASSIGN_OR_RETURN(shape.dtype, ParseDTypeName(request.dtype()));
  if (request.capacity_tokens() > max_capacity_tokens) {
    return InvalidArgumentError("open session: capacity of " +
                                std::to_string(request.capacity_tokens()) + " tokens is too large");
  }
  shape.capacity_tokens = static_cast<uint32_t>(request.capacity_tokens());
  return shape;
}

Result<rpc::OpenSessionResponse> CacheRpcHandler::OnOpenSession(
    rpc::ConnectionId connection, const rpc::OpenSessionRequest& request) {
  RUBATO_ASSIGN_OR_RETURN(const SessionShape shape, SessionShapeOf(request, UINT32_MAX));
  RUBATO_ASSIGN_OR_RETURN(const uint64_t session,
                          service_.OpenSession(connection, request.request_id(), shape,
                                               SelectorSpecFromRequest(request)));
  rpc::OpenSessionResponse response;
  response.set_session_id(session);
  response.set_bytes_reserved(2ull * shape.num_layers * shape.num_kv_heads * shape.capacity_tokens *
                              shape.head_dim * DTypeSize(shape.dtype));
  return response;
}

Result<rpc::CloseSessionResponse> CacheRpcHandler::OnCloseSession(
    rpc::ConnectionId connection, const rpc::CloseSessionRequest& request) {
  RUBATO_RETURN_IF_ERROR(service_.CloseSession(connection, request.session_id()));
  return rpc::CloseSessionResponse();
}

Result<rpc::StatsResponse> CacheRpcHandler::OnStats(rpc::ConnectionId /*connection*/,
                                                    const rpc::StatsRequest& /*request*/) {
  const CacheServiceStats stats = service_.Stats();
  rpc::StatsResponse response;
  response.set_sessions_open(stats.store.sessions_open);
  response.set_bytes_in_use(stats.store.bytes_reserved);
  response.set_bytes_capacity(stats.store.budget_bytes);
  auto& counters = *response.mutable_counters();
  counters["packs_received"] = static_cast<double>(stats.packs_received);
  counters["bytes_received"] = static_cast<double>(stats.bytes_received);
  counters["replies_sent"] = static_cast<double>(stats.replies_sent);
  counters["bytes_sent"] = static_cast<double>(stats.bytes_sent);
  counters["peers"] = static_cast<double>(stats.peers);
  counters["selection_seconds"] = stats.selection_seconds;
  counters["bytes_reserved_peak"] = static_cast<double>(stats.store.bytes_reserved_peak);
  counters["prediction_cosine_sum"] = stats.predictions.cosine_sum;
  counters["prediction_cosine_count"] = static_cast<double>(stats.predictions.cosine_count);
  counters["prediction_overlap_hits"] = static_cast<double>(stats.predictions.overlap_hits);
  counters["prediction_overlap_total"] = static_cast<double>(stats.predictions.overlap_total);
  return response;
}

Result<rpc::HealthResponse> CacheRpcHandler::OnHealth(rpc::ConnectionId connection,
                                                      const rpc::HealthRequest& /*request*/) {
  rpc::HealthResponse response;
  const Status peer = service_.PeerHealth(connection);
  // A connection without a data plane (a control-only client) is healthy as far as it goes.
  response.set_status(peer.ok() || peer.code() == StatusCode::kNotFound ? "ok" : peer.message());
  response.set_uptime_s(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  return response;
}

Result<rpc::ShutdownResponse> ServeShutdown(bool peers_authenticated,
                                            rpc::ConnectionId connection,
                                            const rpc::ShutdownRequest& request,
                                            const std::function<void(const std::string&)>& stop) {
  if (!peers_authenticated) {
    return FailedPreconditionError(
        "Shutdown is served only to authenticated peers: start the cache rank with a token "
        "(RUBATO_CACHE_TOKEN or RUBATO_CACHE_TOKEN_FILE), or stop it with a signal");
  }
  RUBATO_LOG_INFO(kLogSubsystem, "peer {} asks the cache rank to stop: {}", connection,
                  request.reason());
  if (stop) stop(request.reason());
  return rpc::ShutdownResponse();
}

Result<rpc::ShutdownResponse> CacheRpcHandler::OnShutdown(rpc::ConnectionId connection,
                                                          const rpc::ShutdownRequest& request) {
  return ServeShutdown(options_.peers_authenticated, connection, request, on_shutdown_);
}

void CacheRpcHandler::OnConnectionLost(rpc::ConnectionId connection, const Status& reason) {
  RUBATO_LOG_INFO(kLogSubsystem, "peer {} lost ({}): its sessions are freed", connection,
                  reason.message());
  service_.ForgetPeer(connection);
}

}  // namespace rubato
