// DeviceCacheRpcHandler (device_cache_rpc_handler.h): the store made at the first Hello, one
// NCCL communicator and one DeviceAttentionServer thread per connection, sessions on the store.
#include "cache_rank/device/device_cache_rpc_handler.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <atomic>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "cache_rank/cache_rpc_handler.h"
#include "cache_rank/device/device_attention_server.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "transport/nccl_transport.h"

namespace rubato {
namespace {

constexpr const char* kLogSubsystem = "cache";

// The store's request ids are per cache rank; the peers' are their own: one per connection.
uint64_t StoreRequestId(rpc::ConnectionId connection, uint64_t request_id) {
  return (connection << 40) ^ request_id;
}

}  // namespace

struct DeviceCacheRpcHandler::Peer {
  std::unique_ptr<transport::NcclTransport> transport;
  std::unique_ptr<DeviceAttentionServer> server;
  std::thread loop;
  std::atomic<bool> stop{false};
  std::mutex status_mutex;
  Status status;                // the loop's end: why the data plane serves no more
  std::set<uint64_t> sessions;  // under the handler's store_mutex_
};

DeviceCacheRpcHandler::DeviceCacheRpcHandler(std::function<void(const std::string&)> on_shutdown,
                                             const DeviceCacheRpcHandlerOptions& options)
    : on_shutdown_(std::move(on_shutdown)), options_(options) {}

DeviceCacheRpcHandler::~DeviceCacheRpcHandler() {
  std::map<rpc::ConnectionId, std::unique_ptr<Peer>> peers;
  {
    std::lock_guard lock(mutex_);
    peers.swap(peers_);
  }
  for (auto& [connection, peer] : peers) RetirePeer(*peer);
}

Status DeviceCacheRpcHandler::CheckDevice(int device) {
  int count = 0;
  const cudaError_t counted = cudaGetDeviceCount(&count);
  if (counted != cudaSuccess) count = 0;
  if (device < 0 || device >= count) {
    return UnavailableError(
        fmt::format("the cache rank's GPU {} is not there (this process sees "
                    "{} CUDA device(s))",
                    device, count));
  }
  return Status::Ok();
}

Status DeviceCacheRpcHandler::EnsureStore(const rpc::ModelShape& shape) {
  if (store_ != nullptr) {
    const DeviceKvStoreOptions& o = store_->options();
    if (shape.num_layers() != static_cast<uint32_t>(o.num_layers) ||
        shape.num_kv_heads() != static_cast<uint32_t>(o.num_kv_heads) ||
        shape.num_query_heads() != static_cast<uint32_t>(o.num_query_heads) ||
        shape.head_dim() != static_cast<uint32_t>(o.head_dim)) {
      return InvalidArgumentError(fmt::format(
          "hello: a model of {} layers, {} / {} heads, head_dim {}; this cache rank's store "
          "holds {} layers, {} / {} heads, head_dim {}",
          shape.num_layers(), shape.num_query_heads(), shape.num_kv_heads(), shape.head_dim(),
          o.num_layers, o.num_query_heads, o.num_kv_heads, o.head_dim));
    }
    return Status::Ok();
  }
  DeviceKvStoreOptions o;
  o.num_layers = static_cast<int>(shape.num_layers());
  o.num_kv_heads = static_cast<int>(shape.num_kv_heads());
  o.num_query_heads = static_cast<int>(shape.num_query_heads());
  o.head_dim = static_cast<int>(shape.head_dim());
  o.block_tokens = options_.block_tokens;
  o.budget_bytes = options_.budget_bytes;
  o.max_batch = 1;  // the loops plan their own steps; the store only keeps sessions and pools
  o.fixed_workspaces = true;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device), "selecting the cache rank's GPU");
  Result<std::unique_ptr<DeviceKvStore>> store = DeviceKvStore::Create(o);
  if (!store.ok()) {
    return store.status().WithContext(fmt::format("the KV store on GPU {} ({} bytes, {})",
                                                  options_.device, options_.budget_bytes,
                                                  options_.budget_name));
  }
  store_ = std::move(store).value();
  RUBATO_LOG_INFO(kLogSubsystem, "KV store on GPU {}: {} bytes", options_.device,
                  store_->Stats().budget_bytes);
  return Status::Ok();
}

Result<rpc::HelloResponse> DeviceCacheRpcHandler::OnHello(rpc::ConnectionId connection,
                                                          const rpc::HelloRequest& request) {
  rpc::HelloResponse response;
  response.set_cache_memory("device");
  if (request.transport_backend().empty()) return response;  // a control-only peer
  if (request.transport_backend() != "nccl") {
    return UnsupportedError(
        "hello: this cache rank keeps the KV on its GPU (cache.memory device) and is reached by "
        "the device data plane over NCCL, not '" +
        request.transport_backend() + "' (topology.transport: nccl, engine.backend: cuda)");
  }
  const DevicePlaneLimits limits{static_cast<int>(request.device_max_runs()),
                                 static_cast<int>(request.device_max_rows())};
  if (request.device_max_runs() == 0) {
    return FailedPreconditionError(
        "hello: the peer offers no device data plane (a CPU engine, or an older rubato); this "
        "cache rank keeps the KV on its GPU and serves attention there only (start it with "
        "--memory pageable or pinned for layer packs)");
  }
  RUBATO_RETURN_IF_ERROR(limits.Check());
  auto peer = std::make_unique<Peer>();
  {
    std::lock_guard lock(mutex_);
    if (peers_.contains(connection)) {
      return FailedPreconditionError("hello: this connection's data plane is connected already");
    }
    std::lock_guard store_lock(store_mutex_);
    RUBATO_RETURN_IF_ERROR(EnsureStore(request.model_shape()));
  }
  Result<std::unique_ptr<transport::NcclTransport>> joined =
      transport::NcclTransport::Create({.unique_id = request.transport_address(),
                                        .rank = 0,
                                        .world_size = 2,
                                        .device = options_.device,
                                        .init_timeout = options_.nccl_init_timeout});
  if (!joined.ok()) {
    return joined.status().WithContext("hello: joining the peer's NCCL communicator on GPU " +
                                       std::to_string(options_.device) +
                                       " (`rubato cache --device`; each rank needs its own GPU)");
  }
  peer->transport = std::move(joined).value();
  DeviceAttentionServerOptions server_options;
  server_options.limits = limits;
  server_options.peer = 1;
  Peer* raw = peer.get();
  server_options.check_session = [raw](uint64_t session) {
    if (raw->sessions.contains(session)) return Status::Ok();
    return NotFoundError(fmt::format("session {} is not one of this peer's", session));
  };
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device), "selecting the cache rank's GPU");
  RUBATO_ASSIGN_OR_RETURN(
      peer->server,
      DeviceAttentionServer::Create(*store_, store_mutex_, *peer->transport, server_options));
  peer->loop = std::thread([raw, device = options_.device, connection] {
    (void)cudaSetDevice(device);
    Status ended = raw->server->Run(raw->stop);
    if (ended.ok()) ended = UnavailableError("the peer's data plane stopped");
    if (!raw->stop.load()) {
      RUBATO_LOG_WARN(kLogSubsystem, "peer {}: device data plane ended: {}", connection,
                      ended.message());
    }
    std::lock_guard lock(raw->status_mutex);
    raw->status = ended;
  });
  {
    std::lock_guard lock(mutex_);
    peers_.emplace(connection, std::move(peer));
  }
  RUBATO_LOG_INFO(kLogSubsystem,
                  "peer {} (rank {}) connected its device data plane over NCCL (runs {}, rows {})",
                  connection, request.rank(), limits.max_runs, limits.max_rows);
  response.set_transport_backend("nccl");
  return response;
}

Result<rpc::OpenSessionResponse> DeviceCacheRpcHandler::OnOpenSession(
    rpc::ConnectionId connection, const rpc::OpenSessionRequest& request) {
  if (request.selector() != "attention") {
    return UnsupportedError("open session: selector '" + request.selector() +
                            "': this cache rank keeps the KV on its GPU and runs attention there "
                            "(selector attention: dense over offloaded KV); a row selection "
                            "needs a cache rank with cache.memory pageable or pinned");
  }
  RUBATO_ASSIGN_OR_RETURN(const SessionShape shape, SessionShapeOf(request, INT32_MAX));
  std::lock_guard lock(mutex_);
  auto it = peers_.find(connection);
  if (it == peers_.end()) {
    return FailedPreconditionError("open session: this connection has no device data plane");
  }
  std::lock_guard store_lock(store_mutex_);
  Result<uint64_t> session =
      store_->OpenSession(StoreRequestId(connection, request.request_id()), shape);
  if (!session.ok()) {
    if (session.status().code() == StatusCode::kResourceExhausted) {
      return session.status().WithContext(options_.budget_name);
    }
    return session.status();
  }
  it->second->sessions.insert(*session);
  rpc::OpenSessionResponse response;
  response.set_session_id(*session);
  response.set_bytes_reserved(2ull * shape.num_layers * shape.num_kv_heads * shape.capacity_tokens *
                              shape.head_dim * DTypeSize(shape.dtype));
  return response;
}

Result<rpc::CloseSessionResponse> DeviceCacheRpcHandler::OnCloseSession(
    rpc::ConnectionId connection, const rpc::CloseSessionRequest& request) {
  std::lock_guard lock(mutex_);
  auto it = peers_.find(connection);
  std::lock_guard store_lock(store_mutex_);
  if (it == peers_.end() || it->second->sessions.erase(request.session_id()) == 0) {
    return NotFoundError(
        fmt::format("close session: session {} is not this peer's", request.session_id()));
  }
  RUBATO_RETURN_IF_ERROR(store_->CloseSession(request.session_id()));
  return rpc::CloseSessionResponse();
}

Result<rpc::StatsResponse> DeviceCacheRpcHandler::OnStats(rpc::ConnectionId /*connection*/,
                                                          const rpc::StatsRequest& /*request*/) {
  rpc::StatsResponse response;
  const Totals sums = totals();
  std::lock_guard lock(mutex_);
  uint64_t device_bytes = 0;
  {
    std::lock_guard store_lock(store_mutex_);
    if (store_ != nullptr) {
      const DeviceKvStoreStats stats = store_->Stats();
      response.set_sessions_open(stats.sessions_open);
      response.set_bytes_in_use(stats.bytes_reserved);
      response.set_bytes_capacity(stats.budget_bytes);
      device_bytes = stats.device_bytes;
    }
  }
  for (const auto& [connection, peer] : peers_) device_bytes += peer->server->device_bytes();
  auto& counters = *response.mutable_counters();
  counters["steps"] = static_cast<double>(sums.steps);
  counters["bytes_received"] = static_cast<double>(sums.bytes_received);
  counters["bytes_sent"] = static_cast<double>(sums.bytes_sent);
  counters["peers"] = static_cast<double>(peers_.size());
  counters["device_bytes"] = static_cast<double>(device_bytes);
  counters["bytes_reserved_peak"] = static_cast<double>(response.bytes_in_use());
  return response;
}

Result<rpc::HealthResponse> DeviceCacheRpcHandler::OnHealth(rpc::ConnectionId connection,
                                                            const rpc::HealthRequest& /*request*/) {
  rpc::HealthResponse response;
  response.set_status("ok");
  {
    std::lock_guard lock(mutex_);
    auto it = peers_.find(connection);
    if (it != peers_.end()) {
      std::lock_guard status_lock(it->second->status_mutex);
      if (!it->second->status.ok()) response.set_status(it->second->status.message());
    }
  }
  response.set_uptime_s(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  return response;
}

Result<rpc::ShutdownResponse> DeviceCacheRpcHandler::OnShutdown(
    rpc::ConnectionId connection, const rpc::ShutdownRequest& request) {
  return ServeShutdown(options_.peers_authenticated, connection, request, on_shutdown_);
}

void DeviceCacheRpcHandler::OnConnectionLost(rpc::ConnectionId connection, const Status& reason) {
  std::unique_ptr<Peer> peer;
  {
    std::lock_guard lock(mutex_);
    auto it = peers_.find(connection);
    if (it == peers_.end()) return;
    peer = std::move(it->second);
    peers_.erase(it);
  }
  RUBATO_LOG_INFO(kLogSubsystem, "peer {} lost ({}): its loop stops, its sessions are freed",
                  connection, reason.message());
  RetirePeer(*peer);
}

void DeviceCacheRpcHandler::RetirePeer(Peer& peer) {
  // The loop looks at `stop` while it waits for a descriptor; leaving, it cancels that receive,
  // which aborts the communicator: kernels still waiting for the peer end.
  peer.stop = true;
  if (peer.loop.joinable()) peer.loop.join();
  {
    std::lock_guard lock(mutex_);
    totals_.steps += peer.server->stats().steps;
    totals_.bytes_received += peer.server->stats().bytes_received;
    totals_.bytes_sent += peer.server->stats().bytes_sent;
  }
  (void)cudaSetDevice(options_.device);
  peer.server.reset();
  peer.transport.reset();
  std::lock_guard store_lock(store_mutex_);
  for (const uint64_t session : peer.sessions) (void)store_->CloseSession(session);
  peer.sessions.clear();
}

DeviceCacheRpcHandler::Totals DeviceCacheRpcHandler::totals() const {
  std::lock_guard lock(mutex_);
  Totals sums = totals_;
  for (const auto& [connection, peer] : peers_) {
    sums.steps += peer->server->stats().steps;
    sums.bytes_received += peer->server->stats().bytes_received;
    sums.bytes_sent += peer->server->stats().bytes_sent;
  }
  return sums;
}

}  // namespace rubato
