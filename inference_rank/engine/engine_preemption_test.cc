// Tests for the engine's KV pool: sized from (injected) free memory by gpu_memory_utilization and
// never larger than what is free; bad utilizations refused by name; twice the requests the pool
// holds all complete, with preemptions counted, and a preempted request's recomputed tokens equal
// its tokens alone (greedy and seeded sampling).
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"

namespace rubato {
namespace {

// The tiny model with the memory its pool lives in injected: `total` and `free` in blocks.
class InjectedMemoryModel : public Model {
 public:
  InjectedMemoryModel(std::unique_ptr<Model> inner, uint64_t total_blocks, uint64_t free_blocks)
      : inner_(std::move(inner)), total_blocks_(total_blocks), free_blocks_(free_blocks) {}
  const ModelConfig& config() const override { return inner_->config(); }
  std::string_view backend_name() const override { return inner_->backend_name(); }
  size_t weight_bytes() const override { return inner_->weight_bytes(); }
  Result<std::unique_ptr<PagedKvCache>> CreateKvCache(int block_tokens, int num_blocks) override {
    return inner_->CreateKvCache(block_tokens, num_blocks);
  }
  Result<KvPoolMemory> KvPoolMemoryFor(int block_tokens, const StepBounds& bounds) const override {
    RUBATO_ASSIGN_OR_RETURN(KvPoolMemory memory, inner_->KvPoolMemoryFor(block_tokens, bounds));
    memory.where = "injected memory";
    memory.total_bytes = total_blocks_ * memory.bytes_per_block;
    memory.free_bytes = free_blocks_ * memory.bytes_per_block;
    return memory;
  }
  Status Forward(std::span<const ForwardEntry> batch, PagedKvCache& cache, ForwardResult& result,
                 const AttentionWindow& window) override {
    return inner_->Forward(batch, cache, result, window);
  }
  Status SetAttentionBackend(std::unique_ptr<AttentionBackend> backend) override {
    return inner_->SetAttentionBackend(std::move(backend));
  }
  AttentionBackend* attention_backend() override { return inner_->attention_backend(); }

 private:
  std::unique_ptr<Model> inner_;
  uint64_t total_blocks_;
  uint64_t free_blocks_;
};

class EnginePoolTest : public ::testing::Test {
 protected:
  Result<std::unique_ptr<Engine>> Create(const EngineOptions& options, uint64_t total_blocks = 0,
                                         uint64_t free_blocks = 0) {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/4);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    std::unique_ptr<Model> chosen = std::move(model).value();
    if (total_blocks > 0) {
      chosen = std::make_unique<InjectedMemoryModel>(std::move(chosen), total_blocks, free_blocks);
    }
    return Engine::Create(std::move(chosen), options);
  }

  // Steps until no work is left; the tokens of every request. Checks that a request's tokens
  // come one per step at most, that admitted() names a request once, and that the pool is empty
  // at the end.
  std::map<uint64_t, std::vector<int>> Run(Engine& engine) {
    std::map<uint64_t, std::vector<int>> tokens;
    std::set<uint64_t> admitted;
    for (int step = 0; engine.HasWork(); ++step) {
      if (step > 20000) {
        ADD_FAILURE() << "engine did not finish";
        break;
      }
      auto events = engine.Step();
      if (!events.ok()) {
        ADD_FAILURE() << events.status().ToString();
        break;
      }
      for (uint64_t id : engine.admitted()) {
        EXPECT_TRUE(admitted.insert(id).second) << "request " << id << " admitted twice";
      }
      EXPECT_LE(engine.kv_cache().used_blocks(), engine.kv_cache().shape().num_blocks);
      for (const TokenEvent& event : *events) {
        EXPECT_NE(event.finish, FinishReason::kError) << event.error.ToString();
        tokens[event.request_id].push_back(event.token);
      }
    }
    EXPECT_EQ(engine.kv_cache().used_blocks(), 0);
    return tokens;
  }

  TestTempDir dir_{"engine_pool"};
};

// 8 requests of 5..12 prompt tokens and 24 new tokens: 2 or 3 blocks of 16 each, 19 in all,
// against a pool of 9 blocks. Each is admitted with its prompt's one block; decoding past
// position 16 takes a second block, and the pool runs out.
std::vector<GenerationRequest> TwicePoolRequests(bool sampled) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 8; ++i) {
    GenerationRequest request =
        sampled ? engine_test::Sampled(5 + i, i + 1, 24) : GenerationRequest{};
    if (!sampled) {
      request.prompt_ids = engine_test::Prompt(5 + i, i + 1);
      request.max_new_tokens = 24;
    }
    request.stop_token_ids.clear();  // every request runs its 24 tokens
    request.ignore_eos = true;
    requests.push_back(request);
  }
  return requests;
}

TEST_F(EnginePoolTest, TwiceThePoolsRequestsCompleteWithPreemptionsAndTheirTokensAlone) {
  for (bool sampled : {false, true}) {
    SCOPED_TRACE(sampled ? "seeded sampling" : "greedy");
    const std::vector<GenerationRequest> requests = TwicePoolRequests(sampled);
    // Each request alone, in a pool that holds it whole: never preempted.
    std::vector<std::vector<int>> alone;
    for (const GenerationRequest& request : requests) {
      EngineOptions options;
      options.max_batch = 1;
      auto engine = Create(options);
      ASSERT_TRUE(engine.ok()) << engine.status().ToString();
      const uint64_t id = *(*engine)->Submit(request);
      alone.push_back(Run(**engine)[id]);
      EXPECT_EQ((*engine)->num_preemptions(), 0);
      ASSERT_EQ(alone.back().size(), 24u);
    }

    EngineOptions options;
    options.max_batch = 8;
    options.max_kv_blocks = 9;
    options.prefill_chunk = 32;
    auto engine = Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    std::vector<uint64_t> ids;
    for (const GenerationRequest& request : requests) ids.push_back(*(*engine)->Submit(request));
    const std::map<uint64_t, std::vector<int>> together = Run(**engine);
    EXPECT_GT((*engine)->num_preemptions(), 0);
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ(together.at(ids[i]), alone[i]) << "request " << i;
    }
  }
}

// The oldest running request is never the one preempted: alone it always fits.
TEST_F(EnginePoolTest, TheNewestIsPreemptedNeverTheOldest) {
  EngineOptions options;
  options.max_batch = 8;
  options.max_kv_blocks = 9;
  auto engine = Create(options);
  ASSERT_TRUE(engine.ok());
  for (const GenerationRequest& request : TwicePoolRequests(false)) {
    ASSERT_TRUE((*engine)->Submit(request).ok());
  }
  // Request 1 runs from the first step to its last token without a gap.
  int first_tokens = 0;
  int steps_with_preemption = 0;
  while ((*engine)->HasWork() && first_tokens < 24) {
    auto events = (*engine)->Step();
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    if ((*engine)->last_step_preemptions() > 0) {
      ++steps_with_preemption;
      EXPECT_TRUE((*engine)->admitted().empty()) << "admitted in a step that preempted";
    }
    bool first_had_token = false;
    for (const TokenEvent& event : *events) first_had_token |= event.request_id == 1;
    if (first_tokens > 0) {
      EXPECT_TRUE(first_had_token) << "request 1 paused";
    }
    if (first_had_token) ++first_tokens;
  }
  EXPECT_EQ(first_tokens, 24);
  EXPECT_GT(steps_with_preemption, 0);
}

TEST_F(EnginePoolTest, SizedFromInjectedFreeMemoryNeverMoreThanFree) {
  // 1000 blocks of memory, 200 free: 0.9 leaves 900 - 800 = 100 for the pool.
  EngineOptions options;
  options.max_batch = 64;
  auto engine = Create(options, /*total_blocks=*/1000, /*free_blocks=*/200);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_EQ((*engine)->kv_cache().shape().num_blocks, 100);
  EXPECT_EQ((*engine)->options().max_kv_blocks, 100);
  EXPECT_NE((*engine)->kv_pool_summary().find("KV pool of 1600 tokens (100 blocks of 16"),
            std::string::npos)
      << (*engine)->kv_pool_summary();
  EXPECT_NE((*engine)->kv_pool_summary().find("gpu_memory_utilization 0.9 of injected memory"),
            std::string::npos)
      << (*engine)->kv_pool_summary();

  // Utilization 1: everything free, never more.
  options.gpu_memory_utilization = 1.0;
  engine = Create(options, 1000, 200);
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ((*engine)->kv_cache().shape().num_blocks, 200);

  // Plenty of memory: no more blocks than max_batch x max_context can use (512 positions).
  options.max_batch = 2;
  engine = Create(options, 100000, 100000);
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ((*engine)->kv_cache().shape().num_blocks, 2 * 512 / 16);

  // No room for a block: refused with the numbers.
  options.gpu_memory_utilization = 0.5;
  engine = Create(options, 1000, 400);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(engine.status().message().find("engine.gpu_memory_utilization 0.5 of injected memory"),
            std::string::npos)
      << engine.status().message();
}

TEST_F(EnginePoolTest, DefaultPoolFitsThisMachinesFreeMemory) {
  auto engine = Create(EngineOptions{});
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto host = ReadHostMemory();
  ASSERT_TRUE(host.ok());
  EXPECT_LE((*engine)->kv_cache().pool_bytes(), host->free_bytes);
  EXPECT_GT((*engine)->kv_cache().shape().num_blocks, 0);
  EXPECT_EQ((*engine)->options().gpu_memory_utilization, 0.9);
}

TEST_F(EnginePoolTest, BadUtilizationIsRefusedByName) {
  for (double bad : {0.0, -0.1, 1.5}) {
    EngineOptions options;
    options.gpu_memory_utilization = bad;
    auto engine = Create(options);
    ASSERT_FALSE(engine.ok()) << bad;
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("engine.gpu_memory_utilization must be in (0, 1]"),
              std::string::npos)
        << engine.status().message();
  }
}

// A request that could never fit the pool, even alone, is refused with the numbers.
TEST_F(EnginePoolTest, ARequestLargerThanThePoolIsRefused) {
  EngineOptions options;
  options.max_kv_blocks = 4;
  auto engine = Create(options);
  ASSERT_TRUE(engine.ok());
  GenerationRequest request;
  request.prompt_ids = engine_test::Prompt(40, 1);
  request.max_new_tokens = 40;  // 79 positions: 5 blocks
  auto refused = (*engine)->Submit(request);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find(
                "needs 5 KV blocks but the cache has 4 (64 tokens: engine.kv_pool_tokens"),
            std::string::npos)
      << refused.status().message();
  request.max_new_tokens = 24;  // 63 positions: 4 blocks
  EXPECT_TRUE((*engine)->Submit(request).ok());
}

}  // namespace
}  // namespace rubato
