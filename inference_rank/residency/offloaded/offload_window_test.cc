// The local window of offloaded KV (docs/residency.md "The local window"): an offloaded request
// holds its prompt while it prefills, then only the blocks its attention still reads locally.
// The window from the selection; offloaded dense and oracle_topk give the tokens of local dense
// and local oracle_topk in a pool too small for the batch's full contexts, where local KV
// preempts; a context longer than the whole pool runs; blocks go back exactly (finished,
// cancelled); the CPU model refuses to read or write a released position, naming it.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"

namespace rubato {
namespace {

using engine_test::Sampled;

constexpr OracleTopKConfig kTopK{.top_k = 16, .sink_tokens = 4, .recent_window = 8};
// Four requests of 20 prompt tokens and 40 new ones: 59 positions, 4 blocks of 16 each, 16 in
// all. The small pool holds 8: two per request, their prompts' (then their windows': 1 block
// for dense, 2 for oracle_topk's 7 positions before the one written).
constexpr int kRequests = 4;
constexpr int kSmallPool = 8;

struct BatchRun {
  std::map<uint64_t, std::vector<int>> tokens;
  int first_step_admitted = 0;
  int64_t preemptions = 0;
  int peak_blocks = 0;
  // The most blocks held after a step in which no request prefilled, per running request.
  double decode_blocks_per_request = 0.0;
  int free_blocks_after = -1;
  int pool_blocks = 0;
  int local_window = -2;
  uint64_t sessions_open_after = 0;
};

class OffloadWindowTest : public ::testing::Test {
 protected:
  std::unique_ptr<Model> LoadModel() {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/3);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    return std::move(model).value();
  }

  std::unique_ptr<ColocatedCacheRank> MakeCache(const CacheSelectorSpec& selection) {
    CacheClientOptions client;
    client.selection = selection;
    CacheServiceOptions service;
    service.budget_bytes = uint64_t{64} << 20;
    auto cache = ColocatedCacheRank::Create(LoadModel()->config(), client, service);
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    return std::move(cache).value();
  }

  // kRequests sampled requests in a pool of `pool_blocks` (0: sized from memory), offloaded
  // through `cache` when set, under oracle_topk when `topk`; `cancel` is cancelled after 5
  // steps (0: none).
  BatchRun Run(int pool_blocks, ColocatedCacheRank* cache, bool topk, uint64_t cancel = 0) {
    EngineOptions options;
    options.max_batch = kRequests;
    options.max_context = 128;
    options.prefill_chunk = 128;
    options.num_threads = 2;
    options.max_kv_blocks = pool_blocks;
    if (topk) options.policy = std::make_shared<OracleTopKPolicy>(kTopK);
    if (cache != nullptr) {
      options.residency = std::make_shared<OffloadedResidency>(cache->client(), &cache->client());
    }
    auto engine = Engine::Create(LoadModel(), options);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    BatchRun run;
    if (!engine.ok()) return run;
    Engine& e = **engine;
    for (int r = 1; r <= kRequests; ++r) EXPECT_TRUE(e.Submit(Sampled(20, r, 40)).ok());
    for (int step = 0; e.HasWork(); ++step) {
      if (cancel != 0 && step == 5) {
        EXPECT_TRUE(e.Cancel(cancel).ok());
      }
      auto events = e.Step();
      EXPECT_TRUE(events.ok()) << events.status().ToString();
      if (!events.ok()) break;
      if (step == 0) run.first_step_admitted = static_cast<int>(e.admitted().size());
      for (const TokenEvent& event : *events) {
        EXPECT_NE(event.finish, FinishReason::kError) << event.error.message();
        run.tokens[event.request_id].push_back(event.token);
      }
      if (e.last_step_prompt_tokens() == 0 && e.num_running() > 0) {
        run.decode_blocks_per_request =
            std::max(run.decode_blocks_per_request,
                     static_cast<double>(e.kv_cache().used_blocks()) / e.num_running());
      }
    }
    run.preemptions = e.num_preemptions();
    run.peak_blocks = e.peak_used_blocks();
    run.free_blocks_after = e.kv_cache().free_blocks();
    run.pool_blocks = e.kv_cache().shape().num_blocks;
    run.local_window = e.local_window();
    if (cache != nullptr) run.sessions_open_after = cache->service().Stats().store.sessions_open;
    return run;
  }

  TestTempDir dir_{"offload_window"};
};

TEST(OffloadWindow, TheWindowFollowsTheSelection) {
  EXPECT_EQ(*LocalWindowFor(CacheSelectorSpec{.name = "attention"}), 0);
  EXPECT_EQ(*LocalWindowFor(CacheSelectorSpec{.name = "oracle_topk", .recent_tokens = 8}), 7);
  EXPECT_EQ(*LocalWindowFor(CacheSelectorSpec{.name = "asyncspade", .recent_tokens = 8}), 7);
  // A dense warm-up reads the whole context locally: every position is kept.
  EXPECT_EQ(*LocalWindowFor(
                CacheSelectorSpec{.name = "asyncspade", .recent_tokens = 8, .dense_steps = 2}),
            -1);
  EXPECT_FALSE(LocalWindowFor(CacheSelectorSpec{.name = "quest"}).ok());
}

// Offloaded dense in a pool of 8 blocks: all four requests run at once (2 blocks each for the
// prompt, then the one block being written) and give local dense's tokens; local dense on the
// same pool preempts. Every block goes back.
TEST_F(OffloadWindowTest, OffloadedDenseServesInAPoolTooSmallForTheFullContexts) {
  const BatchRun reference = Run(0, nullptr, false);
  ASSERT_EQ(reference.tokens.size(), size_t{kRequests});
  const BatchRun local = Run(kSmallPool, nullptr, false);
  EXPECT_GT(local.preemptions, 0) << "local dense holds every position: 16 blocks in 8";

  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(CacheSelectorSpec{.name = "attention"});
  const BatchRun offloaded = Run(kSmallPool, cache.get(), false);
  EXPECT_EQ(offloaded.local_window, 0);
  EXPECT_EQ(offloaded.first_step_admitted, kRequests);
  EXPECT_EQ(offloaded.preemptions, 0);
  EXPECT_EQ(offloaded.tokens, reference.tokens);
  EXPECT_EQ(offloaded.peak_blocks, kSmallPool);  // the four prompts
  EXPECT_EQ(offloaded.decode_blocks_per_request, 1.0);
  EXPECT_EQ(offloaded.free_blocks_after, offloaded.pool_blocks);
  EXPECT_EQ(offloaded.sessions_open_after, 0u);
}

// Offloaded oracle_topk (top_k 16, sink 4, recent 8) in the same pool: the window is the 7
// positions before the one written (2 blocks), and the tokens are local oracle_topk's.
TEST_F(OffloadWindowTest, OffloadedOracleTopKGivesTheLocalTokensWithTheWindow) {
  const BatchRun reference = Run(0, nullptr, true);
  ASSERT_EQ(reference.tokens.size(), size_t{kRequests});
  const BatchRun local = Run(kSmallPool, nullptr, true);
  EXPECT_GT(local.preemptions, 0);

  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(
      CacheSelectorSpec{.name = "oracle_topk", .top_k = 16, .sink_tokens = 4, .recent_tokens = 8});
  const BatchRun offloaded = Run(kSmallPool, cache.get(), true);
  EXPECT_EQ(offloaded.local_window, 7);
  EXPECT_EQ(offloaded.first_step_admitted, kRequests);
  EXPECT_EQ(offloaded.preemptions, 0);
  EXPECT_EQ(offloaded.tokens, reference.tokens);
  EXPECT_LE(offloaded.decode_blocks_per_request, 2.0);
  EXPECT_EQ(offloaded.free_blocks_after, offloaded.pool_blocks);
  EXPECT_EQ(offloaded.sessions_open_after, 0u);
}

// A context longer than the whole local pool: 20 + 100 positions (8 blocks) in a pool of 4 runs
// to its end offloaded, and local KV refuses it at Submit; a prompt longer than the pool is
// refused offloaded too, naming the prompt and the window.
TEST_F(OffloadWindowTest, AContextLongerThanThePoolRunsOffloaded) {
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(CacheSelectorSpec{.name = "attention"});
  EngineOptions options;
  options.max_batch = 1;
  options.max_context = 128;
  options.num_threads = 2;
  options.max_kv_blocks = 4;
  const EngineOptions local_options = options;
  options.residency = std::make_shared<OffloadedResidency>(cache->client(), &cache->client());
  GenerationRequest long_context = Sampled(20, 1, 100);
  long_context.ignore_eos = true;
  long_context.stop_token_ids.clear();

  auto local = Engine::Create(LoadModel(), local_options);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_EQ((*local)->Submit(long_context).status().code(), StatusCode::kResourceExhausted);

  auto engine = Engine::Create(LoadModel(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const Result<uint64_t> too_long = (*engine)->Submit(Sampled(70, 2, 5));
  EXPECT_EQ(too_long.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(too_long.status().message().find("its prompt (70 tokens) prefills through 5 KV blocks "
                                             "but the cache has 4"),
            std::string::npos)
      << too_long.status().message();
  ASSERT_TRUE((*engine)->Submit(long_context).ok());
  int tokens = 0;
  while ((*engine)->HasWork()) {
    auto events = (*engine)->Step();
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    for (const TokenEvent& event : *events) {
      EXPECT_NE(event.finish, FinishReason::kError) << event.error.message();
      ++tokens;
    }
    EXPECT_LE((*engine)->kv_cache().used_blocks(), 2);
  }
  EXPECT_EQ(tokens, 100);
  EXPECT_EQ((*engine)->kv_cache().free_blocks(), 4);
}

// A request cancelled mid-decode gives back every block it held; the others finish.
TEST_F(OffloadWindowTest, ACancelledRequestGivesBackItsBlocks) {
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(CacheSelectorSpec{.name = "attention"});
  const BatchRun run = Run(kSmallPool, cache.get(), false, /*cancel=*/2);
  EXPECT_EQ(run.tokens.size(), size_t{kRequests});
  EXPECT_LT(run.tokens.at(2).size(), run.tokens.at(1).size());
  EXPECT_EQ(run.free_blocks_after, run.pool_blocks);
  EXPECT_EQ(run.sessions_open_after, 0u);
}

// The CPU model refuses to read or write a position whose block was released, naming it; the
// sequence's release gives back the blocks it still holds.
TEST_F(OffloadWindowTest, TheModelRefusesAReleasedPositionByName) {
  std::unique_ptr<Model> model = LoadModel();
  auto cache = model->CreateKvCache(16, 8);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  KvSequence sequence;
  const std::vector<int> prompt = engine_test::Prompt(40, 1);
  ForwardResult result;
  const std::vector<ForwardEntry> prefill{ForwardEntry{&sequence, prompt, 0, LogitsWanted::kLast}};
  ASSERT_TRUE(model->Forward(prefill, **cache, result, AttentionWindow()).ok());
  ASSERT_TRUE((*cache)->ReleaseBefore(sequence, 33).ok());  // blocks 0 and 1: positions < 32
  EXPECT_EQ(PagedKvCache::HeldBlocks(sequence), 1);
  EXPECT_EQ((*cache)->free_blocks(), 7);

  const int token = 5;
  const std::vector<ForwardEntry> decode{
      ForwardEntry{&sequence, std::span<const int>(&token, 1), 40, LogitsWanted::kLast}};
  const Status read = model->Forward(decode, **cache, result, AttentionWindow());
  EXPECT_EQ(read.code(), StatusCode::kFailedPrecondition) << read.ToString();
  EXPECT_NE(read.message().find("would read position 0, whose KV block this rank released"),
            std::string::npos)
      << read.message();
  const std::vector<ForwardEntry> rewrite{
      ForwardEntry{&sequence, std::span<const int>(&token, 1), 31, LogitsWanted::kLast}};
  const Status write = model->Forward(rewrite, **cache, result, AttentionWindow());
  EXPECT_EQ(write.code(), StatusCode::kFailedPrecondition) << write.ToString();
  EXPECT_NE(write.message().find("writes position 31"), std::string::npos) << write.message();

  ASSERT_TRUE((*cache)->Release(sequence).ok());
  EXPECT_EQ((*cache)->free_blocks(), 8);
}

}  // namespace
}  // namespace rubato
