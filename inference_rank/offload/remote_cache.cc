// RemoteCacheRank (remote_cache.h): RPC Hello with the UCX address exchange, sessions over the
// RPC, the cache rank's health from the heartbeat and its data-plane report.
#include "inference_rank/offload/remote_cache.h"

#include <chrono>
#include <mutex>
#include <span>
#include <utility>

#include "common/dtype.h"

#ifdef RUBATO_HAS_UCX
#include "transport/ucx_transport.h"
#endif

namespace rubato {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// How often a wait asks the cache rank how its side of the data plane is (an RPC round trip);
// the heartbeat state is read on every check.
constexpr milliseconds kHealthCallInterval{200};

}  // namespace

// Sessions and health through the RPC client.
class RemoteCacheRank::RpcSessionControl final : public CacheSessionControl {
 public:
  explicit RpcSessionControl(rpc::RpcClient& rpc) : rpc_(rpc) {}

  Result<uint64_t> OpenSession(uint64_t request_id, const SessionShape& shape,
                               const OffloadSelectionParams& selection) override {
    rpc::OpenSessionRequest request;
    request.set_request_id(request_id);
    request.set_num_layers(shape.num_layers);
    request.set_num_kv_heads(shape.num_kv_heads);
    request.set_num_query_heads(shape.num_query_heads);
    request.set_head_dim(shape.head_dim);
    request.set_dtype(std::string(DTypeName(shape.dtype)));
    request.set_capacity_tokens(shape.capacity_tokens);
    request.set_selection(std::string(OffloadSelectionName(selection.selection)));
    request.set_top_k(static_cast<uint32_t>(selection.top_k));
    request.set_sink_tokens(static_cast<uint32_t>(selection.sink_tokens));
    request.set_recent_tokens(static_cast<uint32_t>(selection.recent_tokens));
    RUBATO_ASSIGN_OR_RETURN(const rpc::OpenSessionResponse response, rpc_.OpenSession(request));
    return response.session_id();
  }

  Status CloseSession(uint64_t session_id) override {
    rpc::CloseSessionRequest request;
    request.set_session_id(session_id);
    return rpc_.CloseSession(request).status();
  }

  Status Health() override {
    if (!rpc_.Healthy()) return rpc_.LostReason();
    std::lock_guard lock(mutex_);
    if (Clock::now() - last_call_ >= kHealthCallInterval) {
      last_call_ = Clock::now();
      const Result<rpc::HealthResponse> health = rpc_.Health();
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
  rpc::RpcClient& rpc_;
  std::mutex mutex_;
  Clock::time_point last_call_{};
  Status data_plane_;
};

Result<std::unique_ptr<RemoteCacheRank>> RemoteCacheRank::Connect(
    const std::string& endpoint, const ModelConfig& model,
    const CacheClientOptions& client_options, const LimitsSection& limits) {
#ifndef RUBATO_HAS_UCX
  return UnsupportedError("cache rank " + endpoint +
                          ": this rubato was built without UCX (RUBATO_UCX), which carries the "
                          "KV to a cache rank in another process");
#else
  std::unique_ptr<RemoteCacheRank> cache(new RemoteCacheRank());
  cache->endpoint_ = endpoint;
  const rpc::RpcClientOptions rpc_options = rpc::RpcClientOptions::FromLimits(limits);
  RUBATO_ASSIGN_OR_RETURN(
      cache->rpc_, rpc::RpcClient::Connect(endpoint, milliseconds(limits.rpc_timeout_ms),
                                           rpc_options));
  // This process is rank 1 of the connection's world of two; the cache rank is rank 0.
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<transport::UcxTransport> ucx,
                          transport::UcxTransport::Create(1, 2));
  rpc::HelloRequest hello;
  hello.set_role(rpc::ROLE_INFERENCE);
  hello.set_rank(1);
  rpc::ModelShape& shape = *hello.mutable_model_shape();
  shape.set_num_layers(static_cast<uint32_t>(model.num_layers));
  shape.set_num_kv_heads(static_cast<uint32_t>(model.num_kv_heads));
  shape.set_num_query_heads(static_cast<uint32_t>(model.num_heads));
  shape.set_head_dim(static_cast<uint32_t>(model.head_dim));
  shape.set_kv_dtype("f32");
  hello.set_transport_backend("ucx");
  const std::span<const std::byte> mine = ucx->LocalAddress();
  hello.set_transport_address(std::string(reinterpret_cast<const char*>(mine.data()), mine.size()));
  Result<rpc::HelloResponse> response = cache->rpc_->Hello(hello);
  if (!response.ok()) return response.status().WithContext("cache rank " + endpoint);
  const std::string& theirs = response->transport_address();
  RUBATO_RETURN_IF_ERROR(
      ucx->Connect(0, std::span<const std::byte>(reinterpret_cast<const std::byte*>(theirs.data()),
                                                 theirs.size()))
          .WithContext("cache rank " + endpoint));
  cache->transport_ = std::move(ucx);
  cache->control_ = std::make_unique<RpcSessionControl>(*cache->rpc_);
  CacheClientOptions options = client_options;
  options.cache_name = "cache rank " + endpoint;
  cache->client_ = std::make_unique<CacheRankClient>(options, model, *cache->transport_,
                                                     /*cache_peer=*/0, *cache->control_);
  return cache;
#endif
}

RemoteCacheRank::~RemoteCacheRank() {
  client_.reset();     // cancels what it still has posted on the transport
  transport_.reset();
  if (rpc_ != nullptr) rpc_->Close();
}

}  // namespace rubato
