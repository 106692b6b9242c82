// Helpers of the device data plane's GPU tests (device_cache_rank_test.cc: one cache rank,
// device_cache_ranks_test.cc: several): a cache rank's loop on a thread of this process, the two
// endpoints of a data plane (cuda_peer or NCCL), a cache rank and its data plane as one
// connection, the parameterised fixture (instantiated in device_cache_rank_test.cc) and the
// engine run on the golden tiny model.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache_rank/device/device_attention_server.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"
#include "tests/golden_reference.h"
#include "transport/cuda_peer_transport.h"
#include "transport/nccl_transport.h"

namespace rubato::device_cache_test {

inline constexpr int kCacheRank = 0;
inline constexpr int kModelRank = 1;

inline int DeviceCount() {
  int devices = 0;
  EXPECT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  return devices;
}

// The cache rank's side in a thread: its store, its server, the loop's end status; sessions
// opened on the store directly (the control plane a process would serve over the RPC).
class CacheRankThread final : public DeviceSessionControl {
 public:
  // Two endpoints of one data plane (kCacheRank, kModelRank), the cache rank's on `device`.
  CacheRankThread(const ModelConfig& config, int device, const DevicePlaneLimits& limits,
                  std::unique_ptr<transport::StreamOrderedTransport> cache_end)
      : config_(config), device_(device), transport_(std::move(cache_end)) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    DeviceKvStoreOptions o;
    o.num_layers = config.num_layers;
    o.num_kv_heads = config.num_kv_heads;
    o.num_query_heads = config.num_heads;
    o.head_dim = config.head_dim;
    o.block_tokens = 16;
    o.budget_bytes = uint64_t{64} << 20;
    o.max_batch = 1;
    o.fixed_workspaces = true;
    auto store = DeviceKvStore::Create(o);
    EXPECT_TRUE(store.ok()) << store.status().message();
    if (!store.ok()) return;
    store_ = std::move(store).value();
    DeviceAttentionServerOptions options;
    options.limits = limits;
    options.peer = kModelRank;
    auto server = DeviceAttentionServer::Create(*store_, mutex_, *transport_, options);
    EXPECT_TRUE(server.ok()) << server.status().message();
    if (!server.ok()) return;
    server_ = std::move(server).value();
    thread_ = std::thread([this] {
      (void)cudaSetDevice(device_);
      const Status ended = server_->Run(stop_);
      std::lock_guard lock(mutex_);
      ended_ = ended.ok() ? Status(StatusCode::kUnavailable, "the cache loop ended") : ended;
      loop_status_ = ended;
    });
  }
  ~CacheRankThread() override { (void)Join(); }

  // The cache rank goes away between steps: its loop ends, Health reports it lost.
  void Lose() {
    (void)Join();
    std::lock_guard lock(mutex_);
    ended_ = UnavailableError("cache rank lost on purpose");
  }

  // Ends the loop (after a stop descriptor it has ended already) and returns its status.
  Status Join() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    return loop_status_;
  }
  bool ready() const { return server_ != nullptr; }
  const DeviceAttentionServer& server() const { return *server_; }

  Result<uint64_t> OpenSession(uint64_t request_id, int capacity_tokens) override {
    SessionShape shape;
    shape.num_layers = config_.num_layers;
    shape.num_kv_heads = config_.num_kv_heads;
    shape.num_query_heads = config_.num_heads;
    shape.head_dim = config_.head_dim;
    shape.dtype = DType::kBF16;
    shape.capacity_tokens = static_cast<uint32_t>(capacity_tokens);
    std::lock_guard lock(mutex_);
    return store_->OpenSession(request_id, shape);
  }
  Status CloseSession(uint64_t session_id) override {
    std::lock_guard lock(mutex_);
    return store_->CloseSession(session_id);
  }
  Status Health() override {
    std::lock_guard lock(mutex_);
    return ended_;
  }
  Result<uint64_t> FreeBytes() override {
    std::lock_guard lock(mutex_);
    const DeviceKvStoreStats stats = store_->Stats();
    return stats.budget_bytes - stats.bytes_reserved;
  }

 private:
  ModelConfig config_;
  int device_ = 0;
  std::unique_ptr<transport::StreamOrderedTransport> transport_;
  std::mutex mutex_;
  std::unique_ptr<DeviceKvStore> store_;
  std::unique_ptr<DeviceAttentionServer> server_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  Status ended_;        // under mutex_: why the loop is gone (Health)
  Status loop_status_;  // Run's result, read after the join
};

// The two endpoints of a data plane: [kCacheRank] on `cache_device`, [kModelRank] on
// `model_device`. Empty (and a skip) when the kind needs more GPUs than there are.
using Endpoints = std::array<std::unique_ptr<transport::StreamOrderedTransport>, 2>;

inline Endpoints MakeEndpoints(const std::string& kind, int model_device, int cache_device,
                               std::unique_ptr<transport::PeerHub>& hub) {
  Endpoints ends;
  if (kind == "cuda_peer") {
    const int devices[2] = {cache_device, model_device};
    auto made = transport::CreateCudaPeerHub(devices);
    EXPECT_TRUE(made.ok()) << made.status().message();
    if (!made.ok()) return ends;
    hub = std::move(made).value();
    for (int r = 0; r < 2; ++r) ends[r] = std::move(hub->Endpoint(r)).value();
    return ends;
  }
  auto id = transport::NcclTransport::NewUniqueId();
  EXPECT_TRUE(id.ok()) << id.status().message();
  if (!id.ok()) return ends;
  Status statuses[2];
  std::thread ranks[2];
  for (int r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      auto created = transport::NcclTransport::Create(
          {.unique_id = *id,
           .rank = r,
           .world_size = 2,
           .device = r == kCacheRank ? cache_device : model_device});
      statuses[r] = created.status();
      if (created.ok()) ends[r] = std::move(created).value();
    });
  }
  for (std::thread& t : ranks) t.join();
  for (const Status& s : statuses) EXPECT_TRUE(s.ok()) << s.message();
  return ends;
}

class DeviceCacheRankTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    devices_ = DeviceCount();
    if (GetParam() == "nccl" && devices_ < 2) {
      GTEST_SKIP() << "NCCL needs two GPUs (nvidia-h200-x2), found " << devices_;
    }
    cache_device_ = devices_ > 1 ? 1 : 0;
  }
  int devices_ = 0;
  int cache_device_ = 0;
};

// The engine runs of the tests: tiny-qwen3-random on GPU 0, three prompts of the golden
// reference's ids (whole, half, seven tokens), 4 requests of 512 positions, chunks of 32.
struct EngineRun {
  explicit EngineRun(bool use_graphs) : use_graphs(use_graphs), config(LoadModelConfig(kModelDir)) {
    options.max_batch = 4;
    options.max_context = 512;
    options.block_size = 16;
    options.prefill_chunk = 32;
    const std::vector<int> ids = golden::LoadGoldenReference("tiny-qwen3-random").prompt_ids;
    prompts = {ids, std::vector<int>(ids.begin(), ids.begin() + ids.size() / 2),
               std::vector<int>(ids.begin(), ids.begin() + std::min<size_t>(7, ids.size()))};
  }
  std::unique_ptr<Model> Load() const {
    auto model = LoadCudaModel(kModelDir, {.device = 0, .use_cuda_graph = use_graphs});
    EXPECT_TRUE(model.ok()) << model.status().message();
    return model.ok() ? std::move(model).value() : nullptr;
  }
  static constexpr const char* kModelDir = "models/tiny-qwen3-random";
  bool use_graphs;
  Result<ModelConfig> config;
  EngineOptions options;
  std::vector<std::vector<int>> prompts;
};

// A cache rank thread on `device` and its data plane to the model's GPU 0, its sessions the
// thread's: what a residency borrows, or owns when a reconnect made it.
class CacheRankConnection final : public DeviceSessionControl {
 public:
  CacheRankConnection(const std::string& kind, const ModelConfig& config, int device,
                      const DevicePlaneLimits& limits) {
    Endpoints ends = MakeEndpoints(kind, 0, device, hub_);
    if (ends[0] == nullptr) return;
    thread_ =
        std::make_unique<CacheRankThread>(config, device, limits, std::move(ends[kCacheRank]));
    if (!thread_->ready()) return;
    model_end_ = std::move(ends[kModelRank]);
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    auto client = DevicePlaneClient::Create(
        config, *model_end_,
        {.limits = limits, .transfer_timeout = std::chrono::milliseconds(5000)});
    EXPECT_TRUE(client.ok()) << client.status().message();
    if (client.ok()) client_ = std::move(client).value();
  }
  bool ready() const { return client_ != nullptr; }
  CacheRankThread& thread() { return *thread_; }
  DevicePlaneClient& client() { return *client_; }
  // A stop descriptor on `stream`, then the loop's end.
  Status Stop(cudaStream_t stream) {
    RUBATO_RETURN_IF_ERROR(client_->Stop(stream));
    return thread_->Join();
  }

  Result<uint64_t> OpenSession(uint64_t request_id, int capacity_tokens) override {
    return thread_->OpenSession(request_id, capacity_tokens);
  }
  Status CloseSession(uint64_t session_id) override { return thread_->CloseSession(session_id); }
  Status Health() override { return thread_->Health(); }
  Result<uint64_t> FreeBytes() override { return thread_->FreeBytes(); }

 private:
  std::unique_ptr<transport::PeerHub> hub_;
  std::unique_ptr<transport::StreamOrderedTransport> model_end_;
  std::unique_ptr<CacheRankThread> thread_;
  std::unique_ptr<DevicePlaneClient> client_;
};

}  // namespace rubato::device_cache_test
