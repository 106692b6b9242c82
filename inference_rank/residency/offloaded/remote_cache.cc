// RemoteCacheRank (remote_cache.h): RPC Hello that connects the data plane (UCX addresses or an
// NCCL unique id), sessions over the RPC, the cache rank's health from the heartbeat and its
// data-plane report.
#include "inference_rank/residency/offloaded/remote_cache.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>

#include "common/dtype.h"

#ifdef RUBATO_HAS_UCX
#include "transport/ucx_transport.h"
#endif
#ifdef RUBATO_HAS_NCCL
#include "transport/nccl_host_staging.h"
#endif

namespace rubato {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// How often a wait asks the cache rank how its side of the data plane is (an RPC round trip);
// the heartbeat state is read on every check.
constexpr milliseconds kHealthCallInterval{200};

}  // namespace

// Sessions and health through the RPC client, timed and counted once RegisterMetrics ran.
class RemoteCacheRank::RpcSessionControl final : public CacheSessionControl {
 public:
  explicit RpcSessionControl(rpc::RpcClient& rpc) : rpc_(rpc) {}

  Status RegisterMetrics(MetricsRegistry& registry) {
    RUBATO_ASSIGN_OR_RETURN(
        latency_, registry.AddHistogram("rubato:cache_rpc_latency_seconds",
                                        "Round trip of the inference rank's control-plane calls "
                                        "to its cache rank (sessions, health), failed ones too.",
                                        {1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5}));
    RUBATO_ASSIGN_OR_RETURN(errors_,
                            registry.AddCounter("rubato:cache_rpc_errors_total",
                                                "Control-plane calls to the cache rank that "
                                                "failed (error reply, timeout, lost link)."));
    return Status::Ok();
  }

  Result<uint64_t> OpenSession(uint64_t request_id, const SessionShape& shape,
                               const CacheSelectorSpec& selection) override {
    rpc::OpenSessionRequest request;
    request.set_request_id(request_id);
    request.set_num_layers(shape.num_layers);
    request.set_num_kv_heads(shape.num_kv_heads);
    request.set_num_query_heads(shape.num_query_heads);
    request.set_head_dim(shape.head_dim);
    request.set_dtype(std::string(DTypeName(shape.dtype)));
    request.set_capacity_tokens(shape.capacity_tokens);
    request.set_selector(selection.name);
    request.set_top_k(static_cast<uint32_t>(selection.top_k));
    request.set_sink_tokens(static_cast<uint32_t>(selection.sink_tokens));
    request.set_recent_tokens(static_cast<uint32_t>(selection.recent_tokens));
    request.set_query_window(static_cast<uint32_t>(selection.query_window));
    request.set_ridge_lambda(selection.ridge_lambda);
    request.set_dense_steps(static_cast<uint32_t>(selection.dense_steps));
    request.set_overlap_every(static_cast<uint32_t>(selection.overlap_every));
    RUBATO_ASSIGN_OR_RETURN(const rpc::OpenSessionResponse response,
                            Timed([&] { return rpc_.OpenSession(request); }));
    return response.session_id();
  }

  Status CloseSession(uint64_t session_id) override {
    rpc::CloseSessionRequest request;
    request.set_session_id(session_id);
    return Timed([&] { return rpc_.CloseSession(request); }).status();
  }

  Status Health() override {
    if (!rpc_.Healthy()) return rpc_.LostReason();
    std::lock_guard lock(mutex_);
    if (Clock::now() - last_call_ >= kHealthCallInterval) {
      last_call_ = Clock::now();
      const Result<rpc::HealthResponse> health = Timed([&] { return rpc_.Health(); });
      if (!health.ok()) {
        data_plane_ = health.status();
      } else if (health->status() != "ok") {
        data_plane_ = UnavailableError(health->status());
      } else {
        data_plane_ = Status::Ok();
      }
    }
    return data_plane_;
  }

 private:
  // Runs one RPC, observing its latency and counting its failure.
  template <typename Call>
  std::invoke_result_t<Call> Timed(Call call) {
    const Clock::time_point start = Clock::now();
    auto result = call();
    if (latency_ != nullptr) {
      latency_->Observe(std::chrono::duration<double>(Clock::now() - start).count());
      if (!result.ok()) errors_->Increment();
    }
    return result;
  }

  rpc::RpcClient& rpc_;
  std::mutex mutex_;
  Clock::time_point last_call_{};
  Status data_plane_;
  Histogram* latency_ = nullptr;  // set by RegisterMetrics
  Counter* errors_ = nullptr;
};

namespace {

// The UCX data plane: this rank's worker address goes in the Hello, the cache rank's comes back.
Result<std::unique_ptr<transport::Transport>> HelloOverUcx(rpc::RpcClient& rpc,
                                                          rpc::HelloRequest hello) {
#ifndef RUBATO_HAS_UCX
  (void)rpc;
  (void)hello;
  return UnsupportedError("this rubato was built without UCX (RUBATO_UCX), which carries the KV "
                          "to a cache rank in another process (or use topology.transport nccl)");
#else
  // This process is rank 1 of the connection's world of two; the cache rank is rank 0.
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<transport::UcxTransport> ucx,
                          transport::UcxTransport::Create(1, 2));
  hello.set_transport_backend("ucx");
  const std::span<const std::byte> mine = ucx->LocalAddress();
  hello.set_transport_address(std::string(reinterpret_cast<const char*>(mine.data()), mine.size()));
  RUBATO_ASSIGN_OR_RETURN(const rpc::HelloResponse response, rpc.Hello(hello));
  const std::string& theirs = response.transport_address();
  RUBATO_RETURN_IF_ERROR(ucx->Connect(
      0, std::span<const std::byte>(reinterpret_cast<const std::byte*>(theirs.data()),
                                    theirs.size())));
  return std::unique_ptr<transport::Transport>(std::move(ucx));
#endif
}

// The NCCL data plane: a new ncclUniqueId goes in the Hello; this rank (1) joins the
// communicator on `device` while the cache rank's handler joins as rank 0 on its GPU; host
// packs are staged through device memory (transport/nccl_host_staging.h).
Result<std::unique_ptr<transport::Transport>> HelloOverNccl(rpc::RpcClient& rpc,
                                                           rpc::HelloRequest hello, int device,
                                                           const LimitsSection& limits) {
#ifndef RUBATO_HAS_NCCL
  (void)rpc;
  (void)hello;
  (void)device;
  (void)limits;
  return UnsupportedError("topology.transport nccl: this rubato was built without NCCL (a CUDA "
                          "build finds it)");
#else
  RUBATO_ASSIGN_OR_RETURN(const std::string id, transport::NcclTransport::NewUniqueId());
  std::atomic<bool> give_up{false};
  Result<std::unique_ptr<transport::NcclTransport>> joined = InternalError("not joined");
  std::thread join([&] {
    joined = transport::NcclTransport::Create(
        {.unique_id = id, .rank = 1, .world_size = 2, .device = device,
         .init_timeout = milliseconds(limits.rpc_timeout_ms), .give_up = &give_up});
  });
  hello.set_transport_backend("nccl");
  hello.set_transport_address(id);
  const Result<rpc::HelloResponse> response = rpc.Hello(hello);
  if (!response.ok()) give_up = true;  // the cache rank will not join
  join.join();
  RUBATO_RETURN_IF_ERROR(response.status());
  if (!joined.ok()) {
    return joined.status().WithContext("joining the cache rank's NCCL communicator on GPU " +
                                       std::to_string(device) +
                                       " (each rank needs a GPU of its own)");
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<transport::NcclHostStagingTransport> staged,
                          transport::NcclHostStagingTransport::Create(std::move(joined).value()));
  return std::unique_ptr<transport::Transport>(std::move(staged));
#endif
}

}  // namespace

Result<std::unique_ptr<RemoteCacheRank>> RemoteCacheRank::Connect(
    const std::string& endpoint, const ModelConfig& model,
    const CacheClientOptions& client_options, const LimitsSection& limits,
    const RemoteDataPlane& data_plane, const std::atomic<bool>* abandon) {
  if (data_plane.backend != TopologySection::Transport::kUcx &&
      data_plane.backend != TopologySection::Transport::kNccl) {
    return UnsupportedError("cache rank " + endpoint + ": topology.transport '" +
                            std::string(ConfigEnumName(data_plane.backend)) +
                            "' cannot reach another process (ucx or nccl can)");
  }
  std::unique_ptr<RemoteCacheRank> cache(new RemoteCacheRank());
  cache->endpoint_ = endpoint;
  rpc::RpcClientOptions rpc_options = rpc::RpcClientOptions::FromLimits(limits);
  rpc_options.abandon = abandon;
  RUBATO_ASSIGN_OR_RETURN(
      cache->rpc_, rpc::RpcClient::Connect(endpoint, milliseconds(limits.rpc_timeout_ms),
                                           rpc_options));
  rpc::HelloRequest hello;
  hello.set_role(rpc::ROLE_INFERENCE);
  hello.set_rank(1);
  rpc::ModelShape& shape = *hello.mutable_model_shape();
  shape.set_num_layers(static_cast<uint32_t>(model.num_layers));
  shape.set_num_kv_heads(static_cast<uint32_t>(model.num_kv_heads));
  shape.set_num_query_heads(static_cast<uint32_t>(model.num_heads));
  shape.set_head_dim(static_cast<uint32_t>(model.head_dim));
  shape.set_kv_dtype("f32");
  Result<std::unique_ptr<transport::Transport>> transport =
      data_plane.backend == TopologySection::Transport::kNccl
          ? HelloOverNccl(*cache->rpc_, hello, data_plane.device, limits)
          : HelloOverUcx(*cache->rpc_, hello);
  if (!transport.ok()) return transport.status().WithContext("cache rank " + endpoint);
  cache->transport_ = std::move(transport).value();
  cache->control_ = std::make_unique<RpcSessionControl>(*cache->rpc_);
  CacheClientOptions options = client_options;
  options.cache_name = "cache rank " + endpoint;
  cache->client_ = std::make_unique<CacheRankClient>(options, model, *cache->transport_,
                                                     /*cache_peer=*/0, *cache->control_);
  RUBATO_RETURN_IF_ERROR(cache->client_->Broken());  // a selection the table refuses
  return cache;
}

Status RemoteCacheRank::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_RETURN_IF_ERROR(client_->RegisterMetrics(registry));
  return control_->RegisterMetrics(registry);
}

RemoteCacheRank::~RemoteCacheRank() {
  client_.reset();     // cancels what it still has posted on the transport
  transport_.reset();
  if (rpc_ != nullptr) rpc_->Close();
}

}  // namespace rubato
