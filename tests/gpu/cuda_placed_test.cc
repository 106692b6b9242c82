// The placed residency on the CUDA engine (docs/residency.md "Placement"): a KV pool on the
// model GPU with room for two of four requests keeps those two whole and places the other two
// on a GPU cache rank of this process (the second GPU when there is one). Each layer the cache
// GPU gets the placed requests' q|k|v rows and attends them while the model GPU attends its
// own rows with the local dense kernel, both with the whole batch's key splits; the greedy
// tokens are local dense's exactly, with local and placed rows interleaved in the batch and
// steps replayed as CUDA graphs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <memory>
#include <vector>

#include "inference_rank/engine/engine.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"
#include "inference_rank/residency/placed/placed_residency.h"

namespace rubato {
namespace {

constexpr int kPromptTokens = 16;  // one block each
// Requests 1 and 3 short (16 + 20: 3 blocks whole), 2 and 4 long (16 + 100: 8 blocks whole).
constexpr int kNewTokens[] = {20, 100, 20, 100};
// 1 local (3), 2 fits no longer (room 6 < 8): placed, 1 block; 3 local (room 5 >= 3); 4 placed
// (room 2 < 8), 1 block. Decode rows alternate: local, placed, local, placed.
constexpr int kPoolBlocks = 9;

class CudaPlacedTest : public ::testing::TestWithParam<const char*> {
 protected:
  std::unique_ptr<Model> Load() {
    auto model = LoadCudaModel(GetParam(), {});
    EXPECT_TRUE(model.ok()) << model.status().message();
    return model.ok() ? std::move(model).value() : nullptr;
  }

  // Greedy tokens of the four requests from one engine; `pool_blocks` 0: sized from memory.
  std::map<uint64_t, std::vector<int>> Generate(std::shared_ptr<Residency> residency,
                                                int pool_blocks) {
    std::unique_ptr<Model> model = Load();
    std::map<uint64_t, std::vector<int>> tokens;
    if (model == nullptr) return tokens;
    const int vocab = model->config().vocab_size;
    EngineOptions options;
    options.max_batch = 4;
    options.max_context = 512;
    options.block_size = 16;
    options.prefill_chunk = 32;
    options.max_kv_blocks = pool_blocks;
    options.residency = std::move(residency);
    auto engine = Engine::Create(std::move(model), options);
    EXPECT_TRUE(engine.ok()) << engine.status().message();
    if (!engine.ok()) return tokens;
    for (int r = 0; r < 4; ++r) {
      GenerationRequest request;
      for (int i = 0; i < kPromptTokens; ++i)
        request.prompt_ids.push_back((i * 19 + r * 7 + 1) % vocab);
      request.max_new_tokens = kNewTokens[r];
      request.ignore_eos = true;
      EXPECT_TRUE((*engine)->Submit(request).ok());
    }
    for (int step = 0; (*engine)->HasWork() && step < 10000; ++step) {
      auto events = (*engine)->Step();
      EXPECT_TRUE(events.ok()) << events.status().message();
      if (!events.ok()) break;
      for (const TokenEvent& event : *events) {
        EXPECT_NE(event.finish, FinishReason::kError) << event.error.message();
        tokens[event.request_id].push_back(event.token);
      }
    }
    EXPECT_EQ((*engine)->num_preemptions(), 0);
    return tokens;
  }
};

TEST_P(CudaPlacedTest, MixedPlacementGivesTheLocalDenseTokens) {
  const std::map<uint64_t, std::vector<int>> dense = Generate(nullptr, 0);
  ASSERT_EQ(dense.size(), 4u);

  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  CacheSection section;
  section.memory = CacheSection::Memory::kDevice;
  section.device = devices > 1 ? 1 : 0;
  section.budget_gib = 0.25;
  auto gpu = std::make_shared<GpuCacheResidency>(section, 512, 4 + 32, 16);
  gpu->set_local_window(0);
  gpu->set_exact_splits(true);  // local dense's bits in every row: the tokens compare exactly
  auto placed = std::make_shared<PlacedResidency>(gpu);
  const std::map<uint64_t, std::vector<int>> mixed = Generate(placed, kPoolBlocks);
  EXPECT_EQ(placed->placed_local(), 2u);
  EXPECT_EQ(placed->placed_cache(), 2u);
  ASSERT_EQ(mixed.size(), dense.size());
  for (const auto& [id, tokens] : dense) {
    ASSERT_EQ(tokens.size(), static_cast<size_t>(kNewTokens[id - 1]));
    EXPECT_EQ(mixed.at(id), tokens) << "request " << id;
  }
  ASSERT_NE(gpu->attention(), nullptr);
  EXPECT_GT(gpu->attention()->total_bytes_out(), 0u);
  std::printf("[ placed    ] %s, cache GPU %d:%s\n", GetParam(), section.device,
              placed->StatsLine().c_str());
}

INSTANTIATE_TEST_SUITE_P(Models, CudaPlacedTest,
                         ::testing::Values("models/tiny-qwen3-random", "models/tiny-qwen3-longctx"),
                         [](const auto& info) {
                           return std::string(info.index == 0 ? "TinyQwen3Random"
                                                              : "TinyQwen3Longctx");
                         });

}  // namespace
}  // namespace rubato
