// A GPU cache rank served by its own loop (cache_rank/device/device_attention_server.h) and the
// inference rank's device data plane (inference_rank/residency/offloaded/device_plane_client.h,
// device_cache_rank_residency.h), one thread each, over cuda_peer (one GPU suffices: both ranks
// on device 0, or the cache on device 1 when there is one) and over NCCL (two GPUs; skipped
// below). The attention rows that come back equal GpuCacheAttention's bit for bit (itself local
// dense's, gpu_cache_attention_test.cc) step after step, and the engine's greedy tokens through
// the cache rank equal local dense's on the golden tiny model, with and without CUDA graphs.
// Several cache ranks: device_cache_ranks_test.cc; helpers: device_cache_rank_test_util.h.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "inference_rank/engine/engine.h"
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"
#include "inference_rank/residency/offloaded/gpu_cache_attention.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/device_cache_rank_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::device_cache_test {
namespace {

using gpu_test::FreshRng;
using gpu_test::RandomBf16Values;
using gpu_test::ToBf16;

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

INSTANTIATE_TEST_SUITE_P(Transports, DeviceCacheRankTest, ::testing::Values("cuda_peer", "nccl"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace rubato::device_cache_test
