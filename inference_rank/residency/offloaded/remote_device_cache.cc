// RemoteDeviceCacheRank (remote_device_cache.h): the Hello that forms the device data plane,
// sessions over the RPC, the watchdog; the residency over several, each reconnected when lost.
#include "inference_rank/residency/offloaded/remote_device_cache.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/logging.h"
#include "kernels/cuda/cuda_status.h"

namespace rubato {
namespace {

using std::chrono::milliseconds;

// How often the watchdog asks the cache rank how its side of the data plane is.
constexpr milliseconds kHealthCallInterval{200};

// The residency over the connections, which it owns; a session that fails to close on a rank
// still working is logged, not returned (the engine's request ends either way).
class OwningDeviceCacheRankResidency final : public Residency {
 public:
  OwningDeviceCacheRankResidency(std::vector<DeviceCacheRankPeer> peers, ReconnectBackoff backoff)
      : residency_(std::move(peers), backoff) {}
  std::string_view name() const override { return residency_.name(); }
  KvResidency kind() const override { return residency_.kind(); }
  Status Check(const AttentionPolicy* policy) const override { return residency_.Check(policy); }
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override {
    return residency_.Attach(model, policy, max_batch);
  }
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id,
                                                 int reserved_tokens) override {
    return residency_.Open(request_id, reserved_tokens);
  }
  Status Close(ResidencyRequest& request) override {
    // Closed even on a lost cache rank, which then only forgets it.
    const Status closed = residency_.Close(request);
    if (!closed.ok() && residency_.RequestBroken(request).ok()) {
      RUBATO_LOG_WARN("engine", "{}", closed.message());
    }
    return Status::Ok();
  }
  Status Broken() const override { return residency_.Broken(); }
  Status RequestBroken(const ResidencyRequest& request) const override {
    return residency_.RequestBroken(request);
  }
  Status RegisterMetrics(MetricsRegistry& registry) override {
    return residency_.RegisterMetrics(registry);
  }
  std::string StatsLine() const override { return residency_.StatsLine(); }

 private:
  DeviceCacheRankResidency residency_;
};

}  // namespace

Result<std::unique_ptr<RemoteDeviceCacheRank>> RemoteDeviceCacheRank::Connect(
    const std::string& endpoint, const ModelConfig& model, const LimitsSection& limits, int device,
    const DevicePlaneLimits& plane, const std::atomic<bool>* abandon) {
  RUBATO_RETURN_IF_ERROR(plane.Check());
  std::unique_ptr<RemoteDeviceCacheRank> cache(new RemoteDeviceCacheRank());
  cache->name_ = "cache rank " + endpoint;
  cache->model_ = model;
  rpc::RpcClientOptions rpc_options = rpc::RpcClientOptions::FromLimits(limits);
  rpc_options.abandon = abandon;
  RUBATO_ASSIGN_OR_RETURN(
      cache->rpc_,
      rpc::RpcClient::Connect(endpoint, milliseconds(limits.rpc_timeout_ms), rpc_options));
  rpc::HelloRequest hello;
  hello.set_role(rpc::ROLE_INFERENCE);
  hello.set_rank(1);
  rpc::ModelShape& shape = *hello.mutable_model_shape();
  shape.set_num_layers(static_cast<uint32_t>(model.num_layers));
  shape.set_num_kv_heads(static_cast<uint32_t>(model.num_kv_heads));
  shape.set_num_query_heads(static_cast<uint32_t>(model.num_heads));
  shape.set_head_dim(static_cast<uint32_t>(model.head_dim));
  shape.set_kv_dtype("bf16");
  RUBATO_ASSIGN_OR_RETURN(const std::string id, transport::NcclTransport::NewUniqueId());
  hello.set_transport_backend("nccl");
  hello.set_transport_address(id);
  hello.set_device_max_runs(static_cast<uint32_t>(plane.max_runs));
  hello.set_device_max_rows(static_cast<uint32_t>(plane.max_rows));
  // This rank (1) joins while the cache rank's handler joins as rank 0 answering the Hello.
  std::atomic<bool> give_up{false};
  Result<std::unique_ptr<transport::NcclTransport>> joined = InternalError("not joined");
  std::thread join([&] {
    joined = transport::NcclTransport::Create({.unique_id = id,
                                               .rank = 1,
                                               .world_size = 2,
                                               .device = device,
                                               .init_timeout = milliseconds(limits.rpc_timeout_ms),
                                               .give_up = &give_up});
  });
  const Result<rpc::HelloResponse> response = cache->rpc_->Hello(hello);
  if (!response.ok()) give_up = true;  // the cache rank will not join
  join.join();
  if (!response.ok()) return response.status().WithContext(cache->name_);
  if (!joined.ok()) {
    return joined.status().WithContext(cache->name_ + ": joining its NCCL communicator on GPU " +
                                       std::to_string(device) +
                                       " (each rank needs a GPU of its own)");
  }
  cache->transport_ = std::move(joined).value();
  if (response->cache_memory() != "device") {
    cache->rpc_->Close();
    return std::unique_ptr<RemoteDeviceCacheRank>();  // host memory: layer packs
  }
  RUBATO_ASSIGN_OR_RETURN(
      cache->client_,
      DevicePlaneClient::Create(
          model, *cache->transport_,
          {.limits = plane, .peer = 0, .transfer_timeout = milliseconds(limits.rpc_timeout_ms)}));
  cache->watchdog_ = std::thread([raw = cache.get(), period = limits.heartbeat_ms] {
    raw->Watch(milliseconds(std::max(period, 10)));
  });
  return cache;
}

RemoteDeviceCacheRank::~RemoteDeviceCacheRank() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  client_.reset();
  // The cache rank retires this peer when the connection closes (its loop ends, its sessions
  // are freed); the communicator goes last.
  if (rpc_ != nullptr) rpc_->Close();
  transport_.reset();
}

void RemoteDeviceCacheRank::Watch(milliseconds period) {
  auto last_call = std::chrono::steady_clock::now() - kHealthCallInterval;
  std::unique_lock lock(mutex_);
  while (!stopping_ && lost_.ok()) {
    wake_.wait_for(lock, std::min(period, kHealthCallInterval));
    if (stopping_) return;
    lock.unlock();
    Status health;
    if (!rpc_->Healthy()) {
      health = rpc_->LostReason();
    } else if (std::chrono::steady_clock::now() - last_call >= kHealthCallInterval) {
      last_call = std::chrono::steady_clock::now();
      const Result<rpc::HealthResponse> answer = rpc_->Health();
      if (!answer.ok()) {
        health = answer.status();
      } else if (answer->status() != "ok") {
        health = UnavailableError(answer->status());
      }
    }
    lock.lock();
    if (!health.ok() && !stopping_) {
      lost_ = UnavailableError(name_ + " is lost: " + health.message());
      RUBATO_LOG_WARN("engine", "{}", lost_.message());
      // The model's stream may wait inside an NCCL receive for it: end that wait.
      transport_->AbortFromAnyThread(lost_);
    }
  }
}

Status RemoteDeviceCacheRank::Health() {
  std::lock_guard lock(mutex_);
  return lost_;
}

Result<uint64_t> RemoteDeviceCacheRank::OpenSession(uint64_t request_id, int capacity_tokens) {
  RUBATO_RETURN_IF_ERROR(Health());
  rpc::OpenSessionRequest request;
  request.set_request_id(request_id);
  request.set_num_layers(static_cast<uint32_t>(model_.num_layers));
  request.set_num_kv_heads(static_cast<uint32_t>(model_.num_kv_heads));
  request.set_num_query_heads(static_cast<uint32_t>(model_.num_heads));
  request.set_head_dim(static_cast<uint32_t>(model_.head_dim));
  request.set_dtype(std::string(DTypeName(DType::kBF16)));
  request.set_capacity_tokens(static_cast<uint64_t>(capacity_tokens));
  request.set_selector("attention");
  RUBATO_ASSIGN_OR_RETURN(const rpc::OpenSessionResponse response, rpc_->OpenSession(request));
  return response.session_id();
}

Result<uint64_t> RemoteDeviceCacheRank::FreeBytes() {
  RUBATO_RETURN_IF_ERROR(Health());
  RUBATO_ASSIGN_OR_RETURN(const rpc::StatsResponse stats, rpc_->Stats());
  return stats.bytes_capacity() > stats.bytes_in_use()
             ? stats.bytes_capacity() - stats.bytes_in_use()
             : 0;
}

Status RemoteDeviceCacheRank::CloseSession(uint64_t session_id) {
  rpc::CloseSessionRequest request;
  request.set_session_id(session_id);
  return rpc_->CloseSession(request).status();
}

Result<std::shared_ptr<Residency>> ConnectDeviceCacheRank(const RubatoConfig& config,
                                                          const ModelConfig& model) {
  const std::vector<std::string>& endpoints = config.topology.cache_endpoints;
  // A step holds at most max_batch requests and their tokens: one decode token each, or a
  // prefill chunk beside the decode rows.
  const DevicePlaneLimits plane{config.engine.max_batch,
                                config.engine.max_batch + config.engine.prefill_chunk};
  const LimitsSection limits = config.limits;
  const int device = config.engine.device;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "selecting the model's GPU");
  const auto host_memory = [&](const std::string& endpoint) {
    return InvalidArgumentError("cache rank " + endpoint +
                                " keeps the KV in host memory while cache rank " + endpoints[0] +
                                " keeps it on its GPU: the cache ranks of one inference rank "
                                "must agree on cache.memory");
  };
  // Every cache rank must answer now; a lost one is connected again on the residency's watcher
  // thread (on the model's GPU, as here).
  std::vector<DeviceCacheRankPeer> peers;
  for (size_t i = 0; i < endpoints.size(); ++i) {
    const std::string& endpoint = endpoints[i];
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<RemoteDeviceCacheRank> cache,
                            RemoteDeviceCacheRank::Connect(endpoint, model, limits, device, plane));
    if (cache == nullptr && i == 0) return std::shared_ptr<Residency>();  // host memory
    if (cache == nullptr) return host_memory(endpoint);
    DeviceCacheRankPeer& peer = peers.emplace_back();
    peer.client = &cache->client();
    peer.name = cache->name();
    peer.owned = std::move(cache);
    peer.reconnect = [endpoint, model, limits, device, plane, refused = host_memory(endpoint)](
                         const std::atomic<bool>* abandon) -> Result<DeviceCacheRankConnection> {
      RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "selecting the model's GPU");
      RUBATO_ASSIGN_OR_RETURN(
          std::unique_ptr<RemoteDeviceCacheRank> again,
          RemoteDeviceCacheRank::Connect(endpoint, model, limits, device, plane, abandon));
      if (again == nullptr) return refused;
      DevicePlaneClient* client = &again->client();
      return DeviceCacheRankConnection{std::move(again), client};
    };
  }
  return std::shared_ptr<Residency>(std::make_shared<OwningDeviceCacheRankResidency>(
      std::move(peers), ReconnectBackoffFromLimits(limits)));
}

}  // namespace rubato
