// A GPU cache rank served by its own loop (cache_rank/device/device_attention_server.h) and the
// inference rank's device data plane (inference_rank/residency/offloaded/device_plane_client.h,
// device_cache_rank_residency.h), one thread each, over cuda_peer (one GPU suffices: both ranks
// on device 0, or the cache on device 1 when there is one) and over NCCL (two GPUs; skipped
// below). The attention rows that come back equal GpuCacheAttention's bit for bit (itself local
// dense's, gpu_cache_attention_test.cc) step after step, and the engine's greedy tokens through
// the cache rank equal local dense's on the golden tiny model, with and without CUDA graphs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cache_rank/device/device_attention_server.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"
#include "inference_rank/residency/offloaded/gpu_cache_attention.h"
#include "tests/golden_reference.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"
#include "transport/cuda_peer_transport.h"
#include "transport/nccl_transport.h"

namespace rubato {
namespace {

using gpu_test::FreshRng;
using gpu_test::RandomBf16Values;
using gpu_test::ToBf16;
using std::chrono::milliseconds;

constexpr int kCacheRank = 0;
constexpr int kModelRank = 1;

int DeviceCount() {
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

Endpoints MakeEndpoints(const std::string& kind, int model_device, int cache_device,
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

ModelConfig SmallConfig() {
  ModelConfig config;
  config.num_layers = 3;
  config.num_heads = 8;
  config.num_kv_heads = 2;
  config.head_dim = 128;
  config.hidden_size = 1024;
  return config;
}

std::vector<uint16_t> Download(const cuda::DeviceBuffer<__nv_bfloat16>& buffer, size_t count) {
  std::vector<uint16_t> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), buffer.data(), count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// Rows of three sessions: a prefill step, then decode steps (with a prefill chunk beside them
// every third step). The attention rows equal GpuCacheAttention's, same device, same rows.
TEST_P(DeviceCacheRankTest, AttentionRowsEqualTheInProcessCacheRanksBits) {
  const ModelConfig config = SmallConfig();
  const DevicePlaneLimits limits{.max_runs = 4, .max_rows = 64};
  std::unique_ptr<transport::PeerHub> hub;
  Endpoints ends = MakeEndpoints(GetParam(), 0, cache_device_, hub);
  ASSERT_NE(ends[0], nullptr);
  CacheRankThread cache(config, cache_device_, limits, std::move(ends[kCacheRank]));
  ASSERT_TRUE(cache.ready());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto client = DevicePlaneClient::Create(config, *ends[kModelRank], {.limits = limits});
  ASSERT_TRUE(client.ok()) << client.status().message();
  GpuCacheAttentionOptions reference_options;
  reference_options.model_device = reference_options.cache_device = 0;
  reference_options.max_rows = limits.max_rows;
  reference_options.max_context = 700;
  reference_options.budget_bytes = size_t{64} << 20;
  auto reference = GpuCacheAttention::Create(config, reference_options);
  ASSERT_TRUE(reference.ok()) << reference.status().message();

  std::vector<uint64_t> sessions;
  std::vector<int> reference_sessions;
  for (int s = 0; s < 3; ++s) {
    auto id = cache.OpenSession(100 + s, 700);
    ASSERT_TRUE(id.ok()) << id.status().message();
    sessions.push_back(*id);
    reference_sessions.push_back(std::move((*reference)->OpenSession(700)).value());
  }
  // The budget is named when it runs out.
  Result<uint64_t> too_big = cache.OpenSession(999, 1 << 20);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("budget"), std::string::npos)
      << too_big.status().message();

  std::mt19937_64 rng = FreshRng();
  const size_t qkv_dim = static_cast<size_t>(config.q_dim() + 2 * config.kv_dim());
  auto qkv = std::move(cuda::DeviceBuffer<__nv_bfloat16>::Allocate(64 * qkv_dim, "qkv")).value();
  auto out =
      std::move(cuda::DeviceBuffer<__nv_bfloat16>::Allocate(64 * config.q_dim(), "out")).value();
  auto expected =
      std::move(cuda::DeviceBuffer<__nv_bfloat16>::Allocate(64 * config.q_dim(), "out")).value();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  int lengths[3] = {0, 0, 0};
  const int prompts[3] = {5, 37, 20};
  for (int step = 0; step < 10; ++step) {
    std::vector<DeviceStepRun> runs;
    std::vector<GpuCacheAttention::Row> rows;
    int decode_rows = 0;
    int keys = 0;
    const auto add = [&](int s, int tokens) {
      runs.push_back(
          {sessions[s], static_cast<uint32_t>(lengths[s]), static_cast<uint32_t>(tokens)});
      for (int t = 0; t < tokens; ++t) rows.push_back({reference_sessions[s], lengths[s]++});
    };
    if (step == 0) {
      for (int s = 0; s < 3; ++s) add(s, prompts[s]);
    } else {
      for (int s = 0; s < 3; ++s) {
        keys = std::max(keys, lengths[s] + 1);
        add(s, 1);
      }
      decode_rows = 3;
      if (step % 3 == 0) {
        const uint64_t chunk_session = *cache.OpenSession(200 + step, 64);
        runs.push_back({chunk_session, 0, 9});  // a new request's first chunk
        for (int t = 0; t < 9; ++t) rows.push_back({reference_sessions[0], 600 + t});
      }
    }
    // A graph-stable bucket above the keys, as the model plans it.
    const int max_seq_len = decode_rows > 0 ? std::max(keys, 512) : 0;
    ASSERT_STATUS_OK((*client)->PlanStep(runs, decode_rows, max_seq_len, stream));
    ASSERT_STATUS_OK((*reference)->PlanStep(rows, decode_rows, stream, max_seq_len));
    for (int layer = 0; layer < config.num_layers; ++layer) {
      const std::vector<__nv_bfloat16> bits = ToBf16(RandomBf16Values(rng, rows.size() * qkv_dim));
      ASSERT_EQ(
          cudaMemcpyAsync(qkv.data(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice, stream),
          cudaSuccess);
      ASSERT_STATUS_OK((*client)->Layer(layer, qkv.data(), out.data(), stream));
      ASSERT_STATUS_OK((*reference)->Layer(layer, qkv.data(), expected.data(), stream));
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      if (decode_rows == 0) continue;
      const size_t count = static_cast<size_t>(decode_rows) * config.q_dim();
      const std::vector<uint16_t> got = Download(out, count);
      const std::vector<uint16_t> want = Download(expected, count);
      size_t differing = 0;
      for (size_t i = 0; i < count; ++i) differing += got[i] != want[i];
      ASSERT_EQ(differing, 0u) << "step " << step << " layer " << layer << ": " << differing
                               << " of " << count << " elements differ";
    }
    // A layer's bytes follow from the rows alone: 3 decode rows back, whatever the context.
    if (decode_rows > 0) {
      EXPECT_EQ((*client)->step_bytes_back(),
                static_cast<size_t>(config.num_layers) * 3 * config.q_dim() * 2);
    }
  }
  ASSERT_STATUS_OK((*client)->Stop(stream));
  ASSERT_STATUS_OK(cache.Join());
  EXPECT_EQ(cache.server().stats().steps.load(), 10u);
  EXPECT_EQ(cache.server().stats().bytes_sent.load(), (*client)->total_bytes_back());
  (void)cudaStreamDestroy(stream);
}

// The engine runs of the tests below: tiny-qwen3-random on GPU 0, three prompts of the golden
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

// The engine's greedy tokens through the cache rank equal local dense's exactly (the same
// kernel attends the same K/V in the same launch shape), eagerly and with decode steps replayed
// as CUDA graphs where the transport allows it (nccl).
void ExpectLocalDenseTokens(const std::string& kind, int cache_device, bool use_graphs) {
  EngineRun run(use_graphs);
  ASSERT_TRUE(run.config.ok()) << run.config.status().message();
  const ModelConfig* config = &*run.config;
  EngineOptions& options = run.options;
  const std::vector<std::vector<int>>& prompts = run.prompts;
  auto load = [&] { return run.Load(); };
  const auto dense = cuda_model_test::EngineGreedyTokens(load(), options, prompts);

  const DevicePlaneLimits limits{.max_runs = 4, .max_rows = 4 * 32};
  std::unique_ptr<transport::PeerHub> hub;
  Endpoints ends = MakeEndpoints(kind, 0, cache_device, hub);
  ASSERT_NE(ends[0], nullptr);
  CacheRankThread cache(*config, cache_device, limits, std::move(ends[kCacheRank]));
  ASSERT_TRUE(cache.ready());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto client = DevicePlaneClient::Create(*config, *ends[kModelRank], {.limits = limits});
  ASSERT_TRUE(client.ok()) << client.status().message();
  auto residency = std::make_shared<DeviceCacheRankResidency>(**client, cache, "cache rank");
  options.residency = residency;
  const auto offloaded = cuda_model_test::EngineGreedyTokens(load(), options, prompts);
  ASSERT_EQ(offloaded.size(), dense.size());
  for (size_t r = 0; r < dense.size(); ++r) {
    ASSERT_FALSE(dense[r].empty());
    EXPECT_EQ(offloaded[r], dense[r]) << kind << " request " << r;
  }
  std::printf("[ device    ] %s graphs %d:%s\n", kind.c_str(), use_graphs,
              residency->StatsLine().c_str());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_STATUS_OK((*client)->Stop(stream));
  (void)cudaStreamDestroy(stream);
  ASSERT_STATUS_OK(cache.Join());
  EXPECT_GT(cache.server().stats().steps.load(), 40u);
}

TEST_P(DeviceCacheRankTest, EngineTokensEqualLocalDenseEagerly) {
  ExpectLocalDenseTokens(GetParam(), cache_device_, /*use_graphs=*/false);
}

TEST_P(DeviceCacheRankTest, EngineTokensEqualLocalDenseWithGraphs) {
  ExpectLocalDenseTokens(GetParam(), cache_device_, /*use_graphs=*/true);
}

// Three cache ranks on the cache GPU, each with a data plane of its own to the model's GPU 0.
struct ThreeCacheRanks {
  std::vector<std::unique_ptr<transport::PeerHub>> hubs;
  std::vector<std::unique_ptr<transport::StreamOrderedTransport>> model_ends;
  std::vector<std::unique_ptr<CacheRankThread>> threads;
  std::vector<std::unique_ptr<DevicePlaneClient>> clients;
  std::shared_ptr<DeviceCacheRankResidency> residency;
};

void MakeThreeCacheRanks(const std::string& kind, const ModelConfig& config, int cache_device,
                         ThreeCacheRanks& ranks) {
  // NCCL: each cache rank on a GPU of its own (1, 2, 3). Three servers of one process on one GPU
  // share a CUDA context, where one's device-synchronising call (a workspace cudaFree) waits for
  // another's NCCL kernel, which waits for the model: separate processes (the launch) or GPUs.
  const bool own_gpus = kind == "nccl";
  const DevicePlaneLimits limits{.max_runs = 4, .max_rows = 4 * 32};
  std::vector<DeviceCacheRankPeer> peers;
  for (int r = 0; r < 3; ++r) {
    ranks.hubs.emplace_back();
    const int device = own_gpus ? 1 + r : cache_device;
    Endpoints ends = MakeEndpoints(kind, 0, device, ranks.hubs.back());
    ASSERT_NE(ends[0], nullptr);
    ranks.threads.push_back(
        std::make_unique<CacheRankThread>(config, device, limits, std::move(ends[kCacheRank])));
    ASSERT_TRUE(ranks.threads.back()->ready());
    ranks.model_ends.push_back(std::move(ends[kModelRank]));
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    auto client = DevicePlaneClient::Create(
        config, *ranks.model_ends.back(),
        {.limits = limits, .transfer_timeout = std::chrono::milliseconds(5000)});
    ASSERT_TRUE(client.ok()) << client.status().message();
    ranks.clients.push_back(std::move(client).value());
    peers.push_back({ranks.clients.back().get(), ranks.threads.back().get(),
                     "cache rank " + std::to_string(r)});
  }
  ranks.residency = std::make_shared<DeviceCacheRankResidency>(std::move(peers));
}

// Three requests over three cache ranks (placed by free budget: one each) give local dense's
// tokens; with `lose_after` >= 0, cache rank 1 goes away after that engine step and only its
// request ends, with an error naming it.
void ExpectThreeCacheRanks(const std::string& kind, int cache_device, bool use_graphs,
                           int lose_after) {
  if (kind == "nccl" && DeviceCount() < 4) {
    GTEST_SKIP() << "three NCCL cache ranks of one process need GPUs 1-3 (nvidia-h200-x4); "
                    "scripts/gpu/lose_cache_rank.py runs three cache processes on two GPUs";
  }
  EngineRun run(use_graphs);
  ASSERT_TRUE(run.config.ok()) << run.config.status().message();
  const ModelConfig* config = &*run.config;
  EngineOptions& options = run.options;
  const std::vector<std::vector<int>>& prompts = run.prompts;
  auto load = [&] { return run.Load(); };
  const auto dense = cuda_model_test::EngineGreedyTokens(load(), options, prompts);

  ThreeCacheRanks ranks;
  MakeThreeCacheRanks(kind, *config, cache_device, ranks);
  ASSERT_NE(ranks.residency, nullptr);
  options.residency = ranks.residency;
  auto engine = Engine::Create(load(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest request;
    request.prompt_ids = prompts[i];
    request.max_new_tokens = 40;
    auto id = (*engine)->Submit(request);
    ASSERT_TRUE(id.ok()) << id.status().message();
    index[*id] = i;
  }
  std::vector<std::vector<int>> tokens(prompts.size());
  std::vector<std::string> errors(prompts.size());
  for (int step = 0; (*engine)->HasWork() && step < 10000; ++step) {
    auto events = (*engine)->Step();
    ASSERT_TRUE(events.ok()) << events.status().message();
    for (const TokenEvent& event : *events) {
      const size_t r = index[event.request_id];
      if (!event.error.ok()) errors[r] = event.error.message();
      if (event.error.ok()) tokens[r].push_back(event.token);
    }
    if (step == lose_after) ranks.threads[1]->Lose();
  }
  int failed = 0;
  for (size_t r = 0; r < prompts.size(); ++r) {
    if (!errors[r].empty()) {
      ++failed;
      EXPECT_NE(errors[r].find("cache rank 1 of 3"), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find("lost on purpose"), std::string::npos) << errors[r];
      continue;
    }
    EXPECT_EQ(tokens[r], dense[r]) << kind << " request " << r;
  }
  EXPECT_EQ(failed, lose_after >= 0 ? 1 : 0);
  std::printf("[ device    ] %s graphs %d, three cache ranks%s:%s\n", kind.c_str(), use_graphs,
              lose_after >= 0 ? ", rank 1 lost" : "", ranks.residency->StatsLine().c_str());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (int r = 0; r < 3; ++r) {
    if (r == 1 && lose_after >= 0) continue;
    ASSERT_STATUS_OK(ranks.clients[static_cast<size_t>(r)]->Stop(stream));
    ASSERT_STATUS_OK(ranks.threads[static_cast<size_t>(r)]->Join());
    // Placement gave every rank a request.
    EXPECT_GT(ranks.threads[static_cast<size_t>(r)]->server().stats().steps.load(), 5u);
  }
  (void)cudaStreamDestroy(stream);
}

TEST_P(DeviceCacheRankTest, ThreeCacheRanksGiveLocalDenseTokensEagerly) {
  ExpectThreeCacheRanks(GetParam(), cache_device_, /*use_graphs=*/false, /*lose_after=*/-1);
}

TEST_P(DeviceCacheRankTest, ThreeCacheRanksGiveLocalDenseTokensWithGraphs) {
  ExpectThreeCacheRanks(GetParam(), cache_device_, /*use_graphs=*/true, /*lose_after=*/-1);
}

TEST_P(DeviceCacheRankTest, LosingOneOfThreeCacheRanksEndsOnlyItsRequest) {
  ExpectThreeCacheRanks(GetParam(), cache_device_, /*use_graphs=*/true, /*lose_after=*/12);
}

INSTANTIATE_TEST_SUITE_P(Transports, DeviceCacheRankTest, ::testing::Values("cuda_peer", "nccl"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace rubato
