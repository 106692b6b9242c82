// The CUDA model with offloaded KV through the colocated cache rank (offloaded_cuda_backend.cc:
// the same client, packs, service and replies as two processes, over the loopback transport, a
// bf16 wire), on the golden checkpoints and the trained tiny-qwen3-longctx: offload-dense
// (attention on the cache rank, computed by the host in f32) and offload-topk equal to local
// dense up to near-ties, a small top_k, (two GPUs) the cache service over NCCL; and through a
// GPU cache rank in this process (gpu_cache_residency.h), local dense's logits bit for bit.
// The scenarios: docs/disaggregated.md "Tests"; results: "The CUDA model" there.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"
#include "tests/golden_reference.h"
#include "tests/gpu/cuda_model_test_util.h"
#include "tests/gpu/gpu_test_util.h"
#ifdef RUBATO_HAS_NCCL
#include <cuda_runtime_api.h>

#include "transport/nccl_host_staging.h"
#endif

namespace rubato {
namespace {

using namespace cuda_model_test;

struct OffloadCase {
  const char* name;
  const char* model_dir;
};

void PrintTo(const OffloadCase& c, std::ostream* os) { *os << c.name; }

const OffloadCase kCases[] = {
    {"tiny-qwen3-random", "models/tiny-qwen3-random"},
    {"tiny-llama3-random", "tests/data/models/tiny-llama3-random"},
    {"tiny-qwen3-longctx", "models/tiny-qwen3-longctx"},
};

// Three prompts: the golden reference's prompt (its prefix for the others), or text for the
// trained model.
std::vector<std::vector<int>> Prompts(const OffloadCase& c) {
  std::vector<int> ids;
  if (std::string(c.name) == "tiny-qwen3-longctx") {
    auto tokenizer = Tokenizer::LoadFromDirectory(c.model_dir);
    EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().message();
    if (!tokenizer.ok()) return {};
    ids = (*tokenizer)
              ->Encode(
                  "The passkey is 71432. Remember it. The grass is green. The sky is blue. The "
                  "grass is "
                  "green. The sky is blue. What is the passkey? The passkey is");
  } else {
    ids = golden::LoadGoldenReference(c.name).prompt_ids;
  }
  const auto prefix = [&ids](size_t n) {
    return std::vector<int>(ids.begin(), ids.begin() + std::min(n, ids.size()));
  };
  return {ids, prefix(ids.size() / 2), prefix(7)};
}

class CudaOffloadTest;
void ExpectSameTokensUpToNearTies(CudaOffloadTest& test, const char* what,
                                  const std::vector<std::vector<int>>& dense,
                                  const std::vector<std::vector<int>>& offloaded,
                                  const CacheClientOptions& client);

class CudaOffloadTest : public ::testing::TestWithParam<OffloadCase> {
 public:
  std::unique_ptr<Model> Load() {
    auto model = LoadCudaModel(GetParam().model_dir, {});
    EXPECT_TRUE(model.ok()) << model.status().message();
    return model.ok() ? std::move(model).value() : nullptr;
  }

  // Greedy tokens of the three prompts batched, prefill in chunks of 32; offloaded through
  // `cache` when set.
  std::vector<std::vector<int>> Generate(ColocatedCacheRank* cache) {
    return GenerateOn(cache != nullptr
                          ? std::make_shared<OffloadedResidency>(cache->client(), &cache->client())
                          : nullptr);
  }
  std::vector<std::vector<int>> GenerateOn(std::shared_ptr<Residency> residency) {
    EngineOptions options;
    options.max_batch = kMaxBatch;
    options.max_context = kMaxContext;
    options.block_size = 16;
    options.prefill_chunk = kPrefillChunk;
    options.residency = std::move(residency);
    return EngineGreedyTokens(Load(), options, Prompts(GetParam()));
  }
  static constexpr int kMaxBatch = 4;
  static constexpr int kMaxContext = 512;
  static constexpr int kPrefillChunk = 32;

  // The offloaded residency over a GPU cache rank of this process: GPU 1 when there is one.
  static std::shared_ptr<GpuCacheResidency> GpuCache(int max_context = kMaxContext) {
    int devices = 0;
    EXPECT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
    CacheSection section;
    section.memory = CacheSection::Memory::kDevice;
    section.device = devices > 1 ? 1 : 0;
    section.budget_gib = 0.25;
    auto residency =
        std::make_shared<GpuCacheResidency>(section, max_context, kMaxBatch + kPrefillChunk);
    residency->set_exact_splits(true);  // every row with local dense's bits
    return residency;
  }

  // A colocated cache rank over the loopback transport, or over `transports` (ranks 0 and 1)
  // when given.
  std::unique_ptr<ColocatedCacheRank> MakeCache(
      const CacheClientOptions& client,
      std::array<std::unique_ptr<transport::Transport>, 2>* transports = nullptr) {
    auto config = LoadModelConfig(GetParam().model_dir);
    EXPECT_TRUE(config.ok()) << config.status().message();
    if (!config.ok()) return nullptr;
    CacheClientOptions bf16_wire = client;  // the CUDA model's K/V dtype on the wire
    bf16_wire.kv_dtype = DType::kBF16;
    CacheServiceOptions service;
    service.budget_bytes = uint64_t{256} << 20;
    auto cache = transports == nullptr
                     ? ColocatedCacheRank::Create(*config, bf16_wire, service)
                     : ColocatedCacheRank::CreateOver(*config, bf16_wire, service,
                                                      std::move((*transports)[0]),
                                                      std::move((*transports)[1]));
    EXPECT_TRUE(cache.ok()) << cache.status().message();
    return cache.ok() ? std::move(cache).value() : nullptr;
  }

  // Greedy tokens offloaded through the cache `make_cache(client options)` gives, for packs of
  // 1 layer and of every layer, equal local dense's; the cache rank answered every pack and
  // every session was closed. `over` names the data plane in the printed line.
  void ExpectOffloadDenseTokens(
      const char* over,
      const std::function<std::unique_ptr<ColocatedCacheRank>(const CacheClientOptions&)>&
          make_cache) {
    const std::vector<std::vector<int>> dense = Generate(nullptr);
    ASSERT_EQ(dense.size(), 3u);
    for (const int pack_layers : {1, 64}) {
      CacheClientOptions client;
      client.pack_layers = pack_layers;
      std::unique_ptr<ColocatedCacheRank> cache = make_cache(client);
      ASSERT_NE(cache, nullptr);
      const std::vector<std::vector<int>> offloaded = Generate(cache.get());
      ASSERT_EQ(offloaded.size(), dense.size());
      ExpectSameTokensUpToNearTies(*this, "offload-dense", dense, offloaded, client);
      const CacheServiceStats stats = cache->service().Stats();
      EXPECT_GT(stats.packs_received, 0u);
      EXPECT_EQ(stats.replies_sent, stats.packs_received);
      EXPECT_EQ(stats.store.sessions_open, 0u) << "every finished request closed its session";
      std::printf(
          "[ offload   ] %s P=%d over %s: %llu packs, %llu bytes in, %llu bytes out; "
          "tokens %s\n",
          GetParam().name, pack_layers, over, static_cast<unsigned long long>(stats.packs_received),
          static_cast<unsigned long long>(stats.bytes_received),
          static_cast<unsigned long long>(stats.bytes_sent),
          offloaded == dense ? "identical" : "DIFFER");
    }
  }
};

// Last-row logits of every step: the prompt prefilled in chunks of 32, then `forced` fed one
// token at a time; offloaded through a session of `cache` when set. [steps][vocab].
std::vector<std::vector<float>> TeacherForced(Model& model, Residency* residency,
                                              const std::vector<int>& prompt,
                                              const std::vector<int>& forced) {
  const int total = static_cast<int>(prompt.size() + forced.size());
  auto kv_cache = NewCache(model, 16, total / 16 + 2);
  KvSequence sequence;
  std::unique_ptr<ResidencyRequest> request;
  if (residency != nullptr) {
    // The residency's model half, as an engine would install it, and the request's storage.
    const Status attached = residency->Attach(model, /*policy=*/nullptr, /*max_batch=*/1);
    EXPECT_TRUE(attached.ok()) << attached.message();
    if (!attached.ok()) return {};
    auto opened = residency->Open(/*request_id=*/1, total - 1);
    EXPECT_TRUE(opened.ok()) << opened.status().message();
    if (!opened.ok()) return {};
    request = std::move(*opened);
  }
  std::vector<std::vector<float>> rows;
  ForwardResult result;
  auto feed = [&](std::span<const int> tokens, int start, bool want) {
    ForwardEntry entry{&sequence, tokens, start, want ? LogitsWanted::kLast : LogitsWanted::kNone};
    if (request != nullptr) request->AttachTo(entry);
    const Status status = model.Forward({&entry, 1}, *kv_cache, result);
    EXPECT_TRUE(status.ok()) << status.message();
    if (status.ok() && want) {
      const auto row = result.EntryLogits(0);
      rows.emplace_back(row.begin(), row.end());
    }
    return status.ok();
  };
  for (size_t begin = 0; begin < prompt.size(); begin += 32) {
    const size_t n = std::min<size_t>(32, prompt.size() - begin);
    if (!feed(std::span(prompt).subspan(begin, n), static_cast<int>(begin),
              begin + n == prompt.size())) {
      return {};
    }
  }
  for (size_t i = 0; i < forced.size(); ++i) {
    const int position = static_cast<int>(prompt.size() + i);
    if (!feed(std::span(forced).subspan(i, 1), position, true)) return {};
  }
  if (request != nullptr) {
    EXPECT_TRUE(residency->Close(*request).ok());
  }
  if (residency != nullptr) {
    EXPECT_TRUE(model.SetResidencyBackend(nullptr).ok());
  }
  return rows;
}

// Greedy choices of rows.
std::vector<int> ArgMaxes(const std::vector<std::vector<float>>& rows) {
  std::vector<int> tokens;
  for (const std::vector<float>& row : rows) {
    tokens.push_back(static_cast<int>(std::max_element(row.begin(), row.end()) - row.begin()));
  }
  return tokens;
}

// Teacher-forced on the same tokens (local dense's greedy continuation), offload-dense's logits
// through a host cache rank (attention computed there in f32, rounded to bf16 once) are as close
// to the f32 CPU model's as local dense's are; through a GPU cache rank of this process they
// are local dense's, bit for bit.
TEST_P(CudaOffloadTest, TeacherForcedLogitsOfOffloadDenseAreLocalDenses) {
  const std::vector<int> prompt = Prompts(GetParam())[0];
  std::unique_ptr<Model> dense_model = Load();
  std::unique_ptr<Model> offload_model = Load();
  auto cpu_model = CpuModel::Load(GetParam().model_dir, {});
  ASSERT_NE(dense_model, nullptr);
  ASSERT_NE(offload_model, nullptr);
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status().message();
  // The forced continuation: local dense's greedy tokens, fed back.
  std::vector<int> forced;
  for (int step = 0; step < 32; ++step) {
    const auto rows = TeacherForced(*dense_model, nullptr, prompt, forced);
    ASSERT_EQ(rows.size(), forced.size() + 1);
    forced.push_back(ArgMaxes(rows).back());
  }
  forced.pop_back();
  const auto dense = TeacherForced(*dense_model, nullptr, prompt, forced);
  const auto cpu = TeacherForced(**cpu_model, nullptr, prompt, forced);
  ASSERT_EQ(cpu.size(), dense.size());
  for (const int pack_layers : {1, 64}) {
    CacheClientOptions client;
    client.pack_layers = pack_layers;
    std::unique_ptr<ColocatedCacheRank> cache = MakeCache(client);
    ASSERT_NE(cache, nullptr);
    OffloadedResidency residency(cache->client(), &cache->client());
    const auto offloaded = TeacherForced(*offload_model, &residency, prompt, forced);
    ASSERT_EQ(offloaded.size(), dense.size());
    double offload_cpu = 0, dense_cpu = 0, offload_dense = 0;
    for (size_t s = 0; s < dense.size(); ++s) {
      offload_cpu = std::max(offload_cpu, RelL2(offloaded[s], cpu[s]));
      dense_cpu = std::max(dense_cpu, RelL2(dense[s], cpu[s]));
      offload_dense = std::max(offload_dense, RelL2(offloaded[s], dense[s]));
    }
    // The host computes the attention in f32 and rounds its output to bf16 once, where the GPU
    // kernel rounds its own: the logits move by bf16's own noise (measured on an H200: offload
    // vs local dense 0.012-0.028 rel L2, local dense vs CPU 0.018-0.027), not beyond it.
    EXPECT_LE(offload_cpu, 1.5 * dense_cpu) << "P " << pack_layers;
    std::printf(
        "[ offload   ] %s P=%d teacher-forced %zu steps, worst row rel L2: offload-dense "
        "vs CPU %.3g, local dense vs CPU %.3g, offload-dense vs local dense %.3g\n",
        GetParam().name, cache->client().pack_layers(), dense.size(), offload_cpu, dense_cpu,
        offload_dense);
  }
  std::shared_ptr<GpuCacheResidency> gpu = GpuCache(static_cast<int>(prompt.size() + 32));
  const auto on_gpu = TeacherForced(*offload_model, gpu.get(), prompt, forced);
  ASSERT_EQ(on_gpu.size(), dense.size());
  for (size_t s = 0; s < dense.size(); ++s) {
    EXPECT_EQ(MaxAbsDiff(on_gpu[s], dense[s]), 0.0) << "GPU cache rank, step " << s;
  }
}

// Greedy engine tokens of offloaded requests equal local dense's up to a divergence, and a
// divergence is a near-tie: teacher-forced on the shared prefix, local dense's top-2 margin at
// that step is within 4x the largest |offload - dense| logit difference there (the rule of
// cuda_model_golden_test.cc's engine test; the engine's batched launches split the attention
// differently from a lone request's, so its rows carry noise of that size, not those values).
// Everything after a divergence is another continuation and is not compared.
void ExpectSameTokensUpToNearTies(CudaOffloadTest& test, const char* what,
                                  const std::vector<std::vector<int>>& dense,
                                  const std::vector<std::vector<int>>& offloaded,
                                  const CacheClientOptions& client) {
  const std::vector<std::vector<int>> prompts = Prompts(test.GetParam());
  ASSERT_EQ(offloaded.size(), dense.size());
  for (size_t r = 0; r < dense.size(); ++r) {
    const std::vector<int>& a = dense[r];
    const std::vector<int>& b = offloaded[r];
    ASSERT_FALSE(a.empty());
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
    std::printf(
        "[ offload   ] %s %s request %zu: %zu dense tokens, %zu offloaded, identical "
        "for %zu\n",
        test.GetParam().name, what, r, a.size(), b.size(), k);
    if (k == a.size() && k == b.size()) continue;
    ASSERT_TRUE(k < a.size() && k < b.size()) << "one run stopped early without diverging";
    std::unique_ptr<Model> dense_model = test.Load();
    std::unique_ptr<Model> offload_model = test.Load();
    std::unique_ptr<ColocatedCacheRank> cache = test.MakeCache(client);
    ASSERT_NE(cache, nullptr);
    const std::vector<int> forced(a.begin(), a.begin() + static_cast<ptrdiff_t>(k));
    const auto dense_rows = TeacherForced(*dense_model, nullptr, prompts[r], forced);
    OffloadedResidency residency(cache->client(), &cache->client());
    const auto offload_rows = TeacherForced(*offload_model, &residency, prompts[r], forced);
    ASSERT_EQ(dense_rows.size(), k + 1);
    ASSERT_EQ(offload_rows.size(), k + 1);
    const double margin = Top2Margin(dense_rows[k]);
    const double diff = MaxAbsDiff(offload_rows[k], dense_rows[k]);
    std::printf(
        "[ offload   ] %s %s request %zu diverges at token %zu: dense %d, offloaded %d, "
        "dense top-2 margin %.4g, max |offload - dense| logit %.4g\n",
        test.GetParam().name, what, r, k, a[k], b[k], margin, diff);
    EXPECT_LE(margin, 4 * diff) << what << " request " << r << ": tokens diverge at " << k
                                << " although local dense's choice was clear";
  }
}

TEST_P(CudaOffloadTest, OffloadDenseGivesTheLocalDenseTokens) {
  ExpectOffloadDenseTokens("the loopback transport",
                           [this](const CacheClientOptions& client) { return MakeCache(client); });
}

#ifdef RUBATO_HAS_NCCL
// The cache service on GPU 1 (rank 0 of the NCCL world), the model and the client on GPU 0.
TEST_P(CudaOffloadTest, OffloadDenseWithTheCacheOnAnotherGpuGivesTheLocalDenseTokens) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  if (devices < 2) GTEST_SKIP() << "needs two GPUs (nvidia-h200-x2), found " << devices;
  ExpectOffloadDenseTokens(
      "NCCL GPU 0 <-> GPU 1",
      [this](const CacheClientOptions& client) -> std::unique_ptr<ColocatedCacheRank> {
        auto pair = transport::CreateNcclHostStagingPair({1, 0});
        EXPECT_TRUE(pair.ok()) << pair.status().message();
        return pair.ok() ? MakeCache(client, &*pair) : nullptr;
      });
}
#endif

// Through a GPU cache rank of this process (the second GPU when there is one), the engine's
// greedy tokens are local dense's exactly: the same kernel attends the same K/V there, in the
// same launch shape; its decode steps replay as CUDA graphs.
TEST_P(CudaOffloadTest, AGpuCacheRankGivesExactlyTheLocalDenseTokens) {
  const std::vector<std::vector<int>> dense = GenerateOn(nullptr);
  std::shared_ptr<GpuCacheResidency> gpu = GpuCache();
  const std::vector<std::vector<int>> offloaded = GenerateOn(gpu);
  ASSERT_EQ(offloaded.size(), dense.size());
  for (size_t r = 0; r < dense.size(); ++r) {
    ASSERT_FALSE(dense[r].empty());
    EXPECT_EQ(offloaded[r], dense[r]) << "request " << r;
  }
  ASSERT_NE(gpu->attention(), nullptr);
  EXPECT_GT(gpu->attention()->total_bytes_out(), 0u);
  std::printf("[ offload   ] %s GPU cache rank:%s\n", GetParam().name, gpu->StatsLine().c_str());
}

TEST_P(CudaOffloadTest, OffloadTopKCoveringTheContextGivesTheLocalDenseTokens) {
  const std::vector<std::vector<int>> dense = Generate(nullptr);
  CacheClientOptions client;
  client.selection =
      CacheSelectorSpec{.name = "oracle_topk", .top_k = 512, .sink_tokens = 4, .recent_tokens = 8};
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(client);
  ASSERT_NE(cache, nullptr);
  const std::vector<std::vector<int>> offloaded = Generate(cache.get());
  ExpectSameTokensUpToNearTies(*this, "offload-topk k=512", dense, offloaded, client);
}

TEST_P(CudaOffloadTest, OffloadTopKWithASmallBudgetRuns) {
  CacheClientOptions client;
  client.selection =
      CacheSelectorSpec{.name = "oracle_topk", .top_k = 4, .sink_tokens = 1, .recent_tokens = 4};
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(client);
  ASSERT_NE(cache, nullptr);
  const std::vector<std::vector<int>> offloaded = Generate(cache.get());
  ASSERT_EQ(offloaded.size(), 3u);
  for (const std::vector<int>& tokens : offloaded) EXPECT_FALSE(tokens.empty());
  EXPECT_EQ(cache->service().Stats().store.sessions_open, 0u);
}

INSTANTIATE_TEST_SUITE_P(Models, CudaOffloadTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) {
                           std::string name = info.param.name;
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

}  // namespace
}  // namespace rubato
