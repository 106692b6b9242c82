// The engine with offloaded KV through the colocated cache rank (the same client, packs and
// service as two processes, over the loopback transport), on the tiny random Qwen3 model:
// offload-dense and offload-topk against local dense, the service's packs, replies and metrics,
// a lost cache rank, budgets and unknown selectors. The scenarios: docs/disaggregated.md "Tests".
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/residency/offloaded/colocated_cache.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"

namespace rubato {
namespace {

using engine_test::Sampled;

struct Output {
  std::vector<int> tokens;
  FinishReason finish = FinishReason::kNone;
  Status error;
};

class OffloadEngineTest : public ::testing::Test {
 protected:
  std::unique_ptr<Model> LoadModel() {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/3);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    return std::move(model).value();
  }

  // Runs three sampled requests (prompts of 37, 20 and 5 tokens) to completion with a prefill
  // chunk of 16 tokens per step; offloaded through `cache` when set (through `through`, a client
  // over it, when that is set too).
  std::map<uint64_t, Output> Run(ColocatedCacheRank* cache, int max_new_tokens = 12,
                                 KvOffloadClient* through = nullptr) {
    EngineOptions options;
    options.max_batch = 4;
    options.max_context = 128;
    options.prefill_chunk = 16;
    options.num_threads = 2;
    if (cache != nullptr) {
      KvOffloadClient& client = through != nullptr ? *through : cache->client();
      options.residency = std::make_shared<OffloadedResidency>(client, &cache->client());
    }
    auto engine = Engine::Create(LoadModel(), options);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    std::map<uint64_t, Output> outputs;
    for (const auto& [length, salt] : {std::pair{37, 1}, std::pair{20, 2}, std::pair{5, 3}}) {
      auto id = (*engine)->Submit(Sampled(length, salt, max_new_tokens));
      EXPECT_TRUE(id.ok()) << id.status().ToString();
    }
    while ((*engine)->HasWork()) {
      auto events = (*engine)->Step();
      EXPECT_TRUE(events.ok()) << events.status().ToString();
      if (!events.ok()) break;
      for (const TokenEvent& event : *events) {
        Output& output = outputs[event.request_id];
        if (event.finish != FinishReason::kError) output.tokens.push_back(event.token);
        output.finish = event.finish;
        output.error = event.error;
      }
    }
    free_blocks_after_ = (*engine)->kv_cache().free_blocks();
    pool_blocks_ = (*engine)->kv_cache().shape().num_blocks;
    return outputs;
  }

  std::unique_ptr<ColocatedCacheRank> MakeCache(const CacheClientOptions& client,
                                                uint64_t budget = uint64_t{64} << 20) {
    auto model = LoadModel();
    CacheServiceOptions service;
    service.budget_bytes = budget;
    auto cache = ColocatedCacheRank::Create(model->config(), client, service);
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    return std::move(cache).value();
  }

  // Batch 4, context 128, offloaded through `cache`.
  static EngineOptions OffloadedOptions(ColocatedCacheRank& cache) {
    EngineOptions options;
    options.max_batch = 4;
    options.max_context = 128;
    options.num_threads = 2;
    options.residency = std::make_shared<OffloadedResidency>(cache.client(), &cache.client());
    return options;
  }

  TestTempDir dir_{"offload_engine"};
  int free_blocks_after_ = -1;  // the KV pool after the last Run
  int pool_blocks_ = 0;
};

TEST_F(OffloadEngineTest, OffloadDenseGivesTheDenseTokensForEveryPackSize) {
  const std::map<uint64_t, Output> dense = Run(nullptr);
  ASSERT_EQ(dense.size(), 3u);
  for (const int pack_layers : {1, 2, 8}) {
    CacheClientOptions client;
    client.pack_layers = pack_layers;
    std::unique_ptr<ColocatedCacheRank> cache = MakeCache(client);
    const std::map<uint64_t, Output> offloaded = Run(cache.get());
    ASSERT_EQ(offloaded.size(), 3u);
    for (const auto& [id, output] : dense) {
      EXPECT_EQ(offloaded.at(id).tokens, output.tokens) << "request " << id << ", P "
                                                        << pack_layers;
      EXPECT_NE(offloaded.at(id).finish, FinishReason::kError) << offloaded.at(id).error.message();
    }
    // Attention on the cache rank serves the same step: packs of one layer whatever P asks, so
    // the tiny model's 2 layers make two packs a step, one reply each.
    EXPECT_EQ(cache->client().pack_layers(), 1);
    const CacheServiceStats stats = cache->service().Stats();
    EXPECT_GT(stats.packs_received, 0u);
    EXPECT_EQ(stats.packs_received % 2, 0u);
    EXPECT_EQ(stats.store.sessions_open, 0u) << "every finished request closed its session";
  }
}

// A client that loses one session's KV (as one of several cache ranks does, multi_cache.h) after
// `lose_after` steps: SessionBroken names it, everything else is forwarded.
class OneSessionLost final : public KvOffloadClient {
 public:
  OneSessionLost(KvOffloadClient& inner, int lost_open, int lose_after)
      : inner_(inner), lost_open_(lost_open), lose_after_(lose_after) {}
  Result<uint64_t> OpenSession(uint64_t request_id, int capacity) override {
    Result<uint64_t> session = inner_.OpenSession(request_id, capacity);
    if (session.ok() && opened_++ == lost_open_) lost_session_ = *session;
    return session;
  }
  Status CloseSession(uint64_t session) override { return inner_.CloseSession(session); }
  Status Broken() const override { return inner_.Broken(); }
  Status SessionBroken(uint64_t session) const override {
    if (session == lost_session_ && steps_ > lose_after_) {
      return UnavailableError("cache rank 1 of 3 (127.0.0.1:7001) is lost");
    }
    return Status::Ok();
  }
  Status LayerComputed(int layer, std::span<const OffloadLayerKv> entries) override {
    if (layer == 0) ++steps_;
    return inner_.LayerComputed(layer, entries);
  }
  Result<OffloadCompactKv> CompactFor(int layer, uint64_t session, int position) override {
    return inner_.CompactFor(layer, session, position);
  }
  bool ServesPartialAttention(uint64_t session) const override {
    return inner_.ServesPartialAttention(session);
  }
  Result<OffloadPartial> PartialFor(int layer, uint64_t session, int position) override {
    return inner_.PartialFor(layer, session, position);
  }

 private:
  KvOffloadClient& inner_;
  const int lost_open_;
  const int lose_after_;
  int opened_ = 0;
  int steps_ = 0;
  uint64_t lost_session_ = ~uint64_t{0};
};

// The engine ends only the request whose storage is lost (Residency::RequestBroken), with the
// error naming the cache rank; the others finish with the dense tokens; every session closes.
TEST_F(OffloadEngineTest, ALostSessionEndsOnlyItsRequest) {
  const std::map<uint64_t, Output> dense = Run(nullptr);
  ASSERT_EQ(dense.size(), 3u);
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(CacheClientOptions{});
  OneSessionLost lossy(cache->client(), /*lost_open=*/1, /*lose_after=*/6);
  const std::map<uint64_t, Output> offloaded = Run(cache.get(), 12, &lossy);
  ASSERT_EQ(offloaded.size(), 3u);
  int failed = 0;
  for (const auto& [id, output] : dense) {
    const Output& got = offloaded.at(id);
    if (got.finish == FinishReason::kError) {
      ++failed;
      EXPECT_NE(got.error.message().find("cache rank 1 of 3 (127.0.0.1:7001) is lost"),
                std::string::npos)
          << got.error.message();
      EXPECT_LT(got.tokens.size(), output.tokens.size());
      continue;
    }
    EXPECT_EQ(got.tokens, output.tokens) << "request " << id;
  }
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(cache->service().Stats().store.sessions_open, 0u);
  EXPECT_EQ(free_blocks_after_, pool_blocks_) << "the failed request's local window went back";
}

TEST_F(OffloadEngineTest, OffloadTopKCoveringTheContextGivesTheDenseTokens) {
  const std::map<uint64_t, Output> dense = Run(nullptr);
  CacheClientOptions client;
  client.selection =
      CacheSelectorSpec{.name = "oracle_topk", .top_k = 128, .sink_tokens = 4, .recent_tokens = 8};
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(client);
  const std::map<uint64_t, Output> offloaded = Run(cache.get());
  for (const auto& [id, output] : dense) {
    EXPECT_EQ(offloaded.at(id).tokens, output.tokens) << "request " << id;
  }
}

TEST_F(OffloadEngineTest, OffloadTopKWithASmallBudgetRunsAndDiffers) {
  const std::map<uint64_t, Output> dense = Run(nullptr, 24);
  CacheClientOptions client;
  client.selection =
      CacheSelectorSpec{.name = "oracle_topk", .top_k = 3, .sink_tokens = 1, .recent_tokens = 2};
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(client);
  const std::map<uint64_t, Output> offloaded = Run(cache.get(), 24);
  bool differs = false;
  for (const auto& [id, output] : dense) {
    ASSERT_NE(offloaded.at(id).finish, FinishReason::kError) << offloaded.at(id).error.message();
    ASSERT_FALSE(offloaded.at(id).tokens.empty());
    differs |= offloaded.at(id).tokens != output.tokens;
  }
  EXPECT_TRUE(differs) << "6 of up to 61 positions attended, yet every token equals dense";
}

TEST_F(OffloadEngineTest, MetricsCountTheBytesTheWaitsAndTheSessions) {
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(CacheClientOptions());
  MetricsRegistry inference_metrics;
  MetricsRegistry cache_metrics;
  ASSERT_TRUE(cache->client().RegisterMetrics(inference_metrics).ok());
  ASSERT_TRUE(cache->service().RegisterMetrics(cache_metrics).ok());
  Run(cache.get());
  const auto sample = [](const std::string& text, const std::string& name) {
    const size_t at = text.find("\n" + name + " ");
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + name.size() + 2));
  };
  const double sent = static_cast<double>(cache->client().bytes_sent());
  const double received = static_cast<double>(cache->client().bytes_received());
  // The service counts a reply once its loop sees the send complete, which may come just after
  // the client has it: wait (bounded) for its last count.
  const std::string served_tx =
      "rubato:transport_bytes_total{role=\"cache\",direction=\"tx\",backend=\"loopback\"}";
  for (int i = 0; i < 500 && sample(cache_metrics.ExpositionText(), served_tx) != received; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const std::string inference = inference_metrics.ExpositionText();
  const std::string served = cache_metrics.ExpositionText();
  ASSERT_GT(sent, 0);
  EXPECT_EQ(sample(inference, "rubato:transport_bytes_total{role=\"inference\",direction=\"tx\","
                              "backend=\"loopback\"}"),
            sent)
      << inference;
  EXPECT_EQ(sample(inference, "rubato:transport_bytes_total{role=\"inference\",direction=\"rx\","
                              "backend=\"loopback\"}"),
            received);
  EXPECT_GT(sample(inference, "rubato:pack_wait_seconds_count"), 0) << inference;
  EXPECT_EQ(sample(inference, "rubato:offload_steps_total"),
            static_cast<double>(cache->client().steps()));
  EXPECT_GT(cache->client().steps(), 0u);
  EXPECT_GT(sample(served, "rubato:selection_latency_seconds_count{selector=\"attention\"}"), 0)
      << served;
  // What one side sent the other received; every session was closed again.
  EXPECT_EQ(sample(served, "rubato:transport_bytes_total{role=\"cache\",direction=\"rx\","
                           "backend=\"loopback\"}"),
            sent)
      << served;
  EXPECT_EQ(sample(served, served_tx), received);
  EXPECT_EQ(sample(served, "rubato:cache_rank_sessions"), 0) << served;
  EXPECT_EQ(sample(served, "rubato:cache_rank_memory_bytes{kind=\"reserved\"}"), 0);
  EXPECT_EQ(sample(served, "rubato:cache_rank_memory_bytes{kind=\"budget\"}"), 64 << 20);
  EXPECT_GT(sample(served, "rubato:cache_rank_memory_bytes{kind=\"peak\"}"), 0);
  EXPECT_EQ(cache->service().Stats().memory, "host");
}

TEST_F(OffloadEngineTest, ALostCacheRankEndsEveryOffloadedRequestWithAnError) {
  CacheClientOptions client;
  client.timeout = std::chrono::milliseconds(2000);
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(client);
  auto engine = Engine::Create(LoadModel(), OffloadedOptions(*cache));
  ASSERT_TRUE(engine.ok());
  for (int salt = 1; salt <= 2; ++salt) ASSERT_TRUE((*engine)->Submit(Sampled(9, salt, 40)).ok());
  for (int step = 0; step < 3; ++step) ASSERT_TRUE((*engine)->Step().ok());
  cache->service().ForgetPeer(ColocatedCacheRank::kPeerId);  // its sessions and data plane go

  const auto start = std::chrono::steady_clock::now();
  std::vector<TokenEvent> errors;
  while ((*engine)->HasWork()) {
    auto events = (*engine)->Step();
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    for (const TokenEvent& event : *events) {
      if (event.finish == FinishReason::kError) errors.push_back(event);
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(2000) * 3);
  ASSERT_EQ(errors.size(), 2u);
  for (const TokenEvent& event : errors) {
    EXPECT_EQ(event.error.code(), StatusCode::kUnavailable) << event.error.message();
    // Named by the client's cache name; here the loopback transport saw the peer go first.
    EXPECT_NE(event.error.message().find("colocated cache"), std::string::npos)
        << event.error.message();
  }
  // Their local windows went back to the pool.
  EXPECT_EQ((*engine)->kv_cache().free_blocks(), (*engine)->kv_cache().shape().num_blocks);
  // New requests on the broken client end at admission, with the same reason.
  ASSERT_TRUE((*engine)->Submit(Sampled(5, 9, 4)).ok());
  auto events = (*engine)->Step();
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].finish, FinishReason::kError);
}

TEST_F(OffloadEngineTest, ASessionOverTheCacheBudgetEndsItsRequestWithTheRefusal) {
  // Each session reserves 2 layers x 2 KV heads x capacity x 16 x 4 bytes x 2 (K and V):
  // 128 tokens -> 64 KiB. A 100 KiB budget takes one request, not two.
  std::unique_ptr<ColocatedCacheRank> cache = MakeCache(CacheClientOptions(), 100 << 10);
  auto engine = Engine::Create(LoadModel(), OffloadedOptions(*cache));
  ASSERT_TRUE(engine.ok());
  GenerationRequest request = Sampled(20, 1, 107);  // 20 + 107 - 1 + 1 = 127 tokens
  ASSERT_TRUE((*engine)->Submit(request).ok());
  ASSERT_TRUE((*engine)->Submit(request).ok());
  auto events = (*engine)->Step();
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 2u);  // request 2 refused at admission, request 1's first token
  const TokenEvent& refused = (*events)[0];
  EXPECT_EQ(refused.request_id, 2u);
  EXPECT_EQ(refused.finish, FinishReason::kError);
  EXPECT_EQ(refused.error.code(), StatusCode::kResourceExhausted) << refused.error.message();
  EXPECT_NE(refused.error.message().find("budget"), std::string::npos) << refused.error.message();
  EXPECT_EQ((*events)[1].request_id, 1u);
  EXPECT_EQ((*events)[1].finish, FinishReason::kNone);
}

TEST_F(OffloadEngineTest, AnUnknownSelectorIsRefusedByNameWhenTheCacheIsMade) {
  CacheClientOptions client;
  client.selection.name = "quest";
  auto cache = ColocatedCacheRank::Create(LoadModel()->config(), client, CacheServiceOptions());
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.status().message(),
            "cache rank: unknown selector 'quest' (known: attention, oracle_topk, asyncspade)");
}

}  // namespace
}  // namespace rubato
