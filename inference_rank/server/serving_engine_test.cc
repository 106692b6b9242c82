// Tests for the ServingEngine on the bundled tiny model: concurrent requests give the text each
// gives alone (greedy), stop strings, the bounded queue, cancellation releasing KV (also
// Engine::Cancel directly, and a cancel that comes with its request), engine refusals, timeouts,
// draining, shutdown, and the serving metrics.
#include "inference_rank/server/serving_engine.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/tokenizer/stream_decoder.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"
#include "inference_rank/server/openai_router.h"

namespace rubato::server {
namespace {

constexpr const char* kModelDir = "models/tiny-qwen3-longctx";
constexpr auto kWait = std::chrono::seconds(20);  // bound on every wait (ASan on 2 cores)

// A cache rank that is gone: no session opens, and the client reports itself broken.
class LostCacheRank : public KvOffloadClient {
 public:
  Status LayerComputed(int, std::span<const OffloadLayerKv>) override { return Lost(); }
  Result<OffloadCompactKv> CompactFor(int, uint64_t, int) override { return Lost(); }
  Result<uint64_t> OpenSession(uint64_t, int) override { return Lost(); }
  Status CloseSession(uint64_t) override { return Status::Ok(); }
  Status Broken() const override { return Lost(); }

 private:
  static Status Lost() { return UnavailableError("cache rank 127.0.0.1:7000 stopped answering"); }
};

// A cache rank whose budget is spent: every session is refused, the link itself is fine.
class FullCacheRank : public KvOffloadClient {
 public:
  Status LayerComputed(int, std::span<const OffloadLayerKv>) override { return Status::Ok(); }
  Result<OffloadCompactKv> CompactFor(int, uint64_t, int) override {
    return InternalError("no session is open");
  }
  Result<uint64_t> OpenSession(uint64_t, int) override {
    return ResourceExhaustedError(
        "cache rank 127.0.0.1:7000: the session needs 4096 bytes but "
        "the budget's 1024 bytes are in use");
  }
  Status CloseSession(uint64_t) override { return Status::Ok(); }
  Status Broken() const override { return Status::Ok(); }
};

std::unique_ptr<Engine> MakeEngine(int max_batch, MetricsRegistry* metrics = nullptr,
                                   KvOffloadClient* offload = nullptr) {
  Result<std::unique_ptr<CpuModel>> model = CpuModel::Load(kModelDir, ModelLoadOptions{});
  EXPECT_TRUE(model.ok()) << model.status().message();
  EngineOptions options;
  options.max_batch = max_batch;
  options.max_context = 1024;
  options.num_threads = 1;
  options.metrics = metrics;
  if (offload != nullptr) options.residency = std::make_shared<OffloadedResidency>(*offload);
  Result<std::unique_ptr<Engine>> engine = Engine::Create(std::move(model).value(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().message();
  return std::move(engine).value();
}

class ServingEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::LoadFromDirectory(kModelDir);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().message();
    tokenizer_ = std::move(tokenizer).value();
  }

  // A started ServingEngine over MakeEngine(max_batch), its metrics (and the engine's) in
  // `metrics`; null after a failure.
  std::unique_ptr<ServingEngine> StartMetered(MetricsRegistry& metrics, int max_batch) {
    ServingEngineOptions options;
    options.metrics = &metrics;
    Result<std::unique_ptr<ServingEngine>> serving =
        ServingEngine::Create(MakeEngine(max_batch, &metrics), tokenizer_.get(), options);
    if (!serving.ok()) {
      ADD_FAILURE() << serving.status().message();
      return nullptr;
    }
    (*serving)->Start();
    return std::move(serving).value();
  }

  std::vector<int> Encode(const std::string& text) const {
    return tokenizer_->Encode(text, /*add_special_tokens=*/true);
  }

  // The text one Engine gives for `prompt` alone, as `rubato generate` prints it.
  std::string GenerateAlone(const std::string& prompt, int max_tokens) {
    std::unique_ptr<Engine> engine = MakeEngine(1);
    GenerationRequest request;
    request.prompt_ids = Encode(prompt);
    request.max_new_tokens = max_tokens;
    EXPECT_TRUE(engine->Submit(request).ok());
    StreamDecoder decoder(*tokenizer_, /*skip_special_tokens=*/true);
    std::string text;
    while (engine->HasWork()) {
      Result<std::vector<TokenEvent>> events = engine->Step();
      EXPECT_TRUE(events.ok());
      for (const TokenEvent& event : *events) {
        if (event.finish != FinishReason::kStop) text += decoder.Push(event.token);
      }
    }
    return text + decoder.Flush();
  }

  std::unique_ptr<Tokenizer> tokenizer_;
};

// Collects the updates of many requests; waits are bounded.
class Collector {
 public:
  struct Outcome {
    std::string text;
    int updates = 0;
    ServingUpdate last;
    bool finished = false;
  };

  std::function<void(const ServingUpdate&)> Callback(int key) {
    return [this, key](const ServingUpdate& update) {
      std::lock_guard<std::mutex> lock(mutex_);
      Outcome& outcome = outcomes_[key];
      EXPECT_FALSE(outcome.finished) << "an update after the finished one";
      outcome.text += update.text;
      ++outcome.updates;
      outcome.last = update;
      outcome.finished = update.finished;
      changed_.notify_all();
    };
  }
  bool WaitFinished(int count) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kWait, [&] {
      int finished = 0;
      for (const auto& [key, outcome] : outcomes_) finished += outcome.finished;
      return finished >= count;
    });
  }
  bool WaitUpdates(int key, int count) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kWait, [&] { return outcomes_[key].updates >= count; });
  }
  Outcome Get(int key) {
    std::lock_guard<std::mutex> lock(mutex_);
    return outcomes_[key];
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<int, Outcome> outcomes_;
};

ServingRequest Greedy(std::vector<int> prompt, int max_tokens,
                      std::function<void(const ServingUpdate&)> on_update) {
  ServingRequest request;
  request.generation.prompt_ids = std::move(prompt);
  request.generation.max_new_tokens = max_tokens;
  request.on_update = std::move(on_update);
  return request;
}

TEST_F(ServingEngineTest, ConcurrentRequestsGiveTheTextEachGivesAlone) {
  const std::vector<std::string> prompts = {"Once upon a time", "The cat sat on",
                                            "In the beginning", "Hello, my name is"};
  MetricsRegistry metrics;
  ServingEngineOptions options;
  options.metrics = &metrics;
  options.model_name = "tiny";
  auto serving = ServingEngine::Create(MakeEngine(4, &metrics), tokenizer_.get(), options);
  ASSERT_TRUE(serving.ok()) << serving.status().message();
  Collector collector;
  int prompt_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    prompt_tokens += static_cast<int>(Encode(prompts[i]).size());
    ASSERT_TRUE((*serving)->Submit(Greedy(Encode(prompts[i]), 12, collector.Callback(i))).ok());
  }
  (*serving)->Start();  // all four queued first: they run as one batch
  ASSERT_TRUE(collector.WaitFinished(4));
  int completion_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Collector::Outcome outcome = collector.Get(i);
    EXPECT_TRUE(outcome.last.error.ok()) << outcome.last.error.message();
    EXPECT_EQ(outcome.text, GenerateAlone(prompts[i], 12)) << prompts[i];
    EXPECT_EQ(outcome.last.prompt_tokens, static_cast<int>(Encode(prompts[i]).size()));
    completion_tokens += outcome.last.completion_tokens;
    if (outcome.last.finish_reason == "length") {
      EXPECT_EQ(outcome.last.completion_tokens, 12);
    }
  }
  (*serving)->Stop();
  const std::string exposition = metrics.ExpositionText();
  const std::string model = "{model_name=\"tiny\"} ";
  EXPECT_NE(
      exposition.find("rubato:prompt_tokens_total" + model + std::to_string(prompt_tokens) + "\n"),
      std::string::npos)
      << exposition;
  EXPECT_NE(exposition.find("rubato:generation_tokens_total" + model +
                            std::to_string(completion_tokens) + "\n"),
            std::string::npos);
  for (const char* histogram :
       {"rubato:time_to_first_token_seconds", "rubato:e2e_request_latency_seconds",
        "rubato:request_queue_time_seconds", "rubato:request_prefill_time_seconds",
        "rubato:request_decode_time_seconds", "rubato:request_prompt_tokens",
        "rubato:request_generation_tokens"}) {
    EXPECT_NE(exposition.find(std::string(histogram) + "_count" + model + "4\n"), std::string::npos)
        << histogram;
  }
  EXPECT_NE(exposition.find("rubato:request_prompt_tokens_sum" + model +
                            std::to_string(prompt_tokens) + "\n"),
            std::string::npos);
  EXPECT_NE(exposition.find("rubato:request_generation_tokens_sum" + model +
                            std::to_string(completion_tokens) + "\n"),
            std::string::npos);
  // vLLM's upper bounds: first token to 2560 s, inter-token to 80 s, end to end to 7680 s.
  EXPECT_NE(exposition.find("rubato:time_to_first_token_seconds_bucket{model_name=\"tiny\","
                            "le=\"2560\"} 4\n"),
            std::string::npos);
  EXPECT_NE(exposition.find("rubato:inter_token_latency_seconds_bucket{model_name=\"tiny\","
                            "le=\"80\"}"),
            std::string::npos);
  EXPECT_NE(exposition.find("rubato:e2e_request_latency_seconds_bucket{model_name=\"tiny\","
                            "le=\"7680\"} 4\n"),
            std::string::npos);
  EXPECT_NE(exposition.find("rubato:num_requests_running" + model + "0\n"), std::string::npos);
}

TEST_F(ServingEngineTest, RequestEndsAreCountedByKind) {
  MetricsRegistry metrics;
  ServingEngineOptions options;
  options.metrics = &metrics;
  options.model_name = "tiny";
  options.max_queue = 1;
  auto serving = ServingEngine::Create(MakeEngine(1, &metrics), tokenizer_.get(), options);
  ASSERT_TRUE(serving.ok());
  Collector collector;
  // Queue full (not started): one rejected.
  Result<uint64_t> first =
      (*serving)->Submit(Greedy(Encode("Once upon a time"), 900, collector.Callback(0)));
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE((*serving)->Submit(Greedy(Encode("b"), 2, collector.Callback(1))).ok());
  (*serving)->Start();
  ASSERT_TRUE(collector.WaitUpdates(0, 1));
  (*serving)->Cancel(*first);  // its client went away: aborted
  ASSERT_TRUE(collector.WaitFinished(1));
  ServingRequest bad = Greedy({1, 2}, 4, collector.Callback(2));
  bad.generation.sampling.top_p = 0.f;  // the engine refuses it: rejected
  ASSERT_TRUE((*serving)->Submit(std::move(bad)).ok());
  ASSERT_TRUE(collector.WaitFinished(2));
  ASSERT_TRUE((*serving)->Submit(Greedy(Encode("a b"), 2, collector.Callback(3))).ok());
  ASSERT_TRUE(collector.WaitFinished(3));
  (*serving)->Stop();
  const std::string exposition = metrics.ExpositionText();
  const std::string model = "{model_name=\"tiny\"} ";
  EXPECT_NE(exposition.find("rubato:requests_rejected_total" + model + "2\n"), std::string::npos)
      << exposition;
  EXPECT_NE(exposition.find("rubato:requests_aborted_total" + model + "1\n"), std::string::npos);
  EXPECT_NE(exposition.find("rubato:requests_failed_total" + model + "0\n"), std::string::npos);
  EXPECT_NE(exposition.find("rubato:requests_timed_out_total" + model + "0\n"), std::string::npos);
  const std::string finished = collector.Get(3).last.finish_reason;
  EXPECT_NE(exposition.find("rubato:request_success_total{model_name=\"tiny\",finished_reason=\"" +
                            finished + "\"} 1\n"),
            std::string::npos);
  // The prompt tokens count at admission: the aborted request's and the last one's.
  EXPECT_NE(exposition.find(
                "rubato:prompt_tokens_total" + model +
                std::to_string(Encode("Once upon a time").size() + Encode("a b").size()) + "\n"),
            std::string::npos);
}

TEST(ServingMetricsTest, OneTwoFiveBucketsStopAtTheContext) {
  EXPECT_EQ(OneTwoFiveBuckets(1), std::vector<double>({1}));
  EXPECT_EQ(OneTwoFiveBuckets(60), std::vector<double>({1, 2, 5, 10, 20, 50}));
  EXPECT_EQ(OneTwoFiveBuckets(100), std::vector<double>({1, 2, 5, 10, 20, 50, 100}));
}

TEST_F(ServingEngineTest, StopStringEndsTheTextBeforeIt) {
  const std::string full = GenerateAlone("Once upon a time", 24);
  ASSERT_GT(full.size(), 16u);
  const std::string stop = full.substr(8, 3);
  const size_t first = full.find(stop);
  auto serving = ServingEngine::Create(MakeEngine(2), tokenizer_.get(), {});
  ASSERT_TRUE(serving.ok());
  (*serving)->Start();
  Collector collector;
  ServingRequest request = Greedy(Encode("Once upon a time"), 24, collector.Callback(0));
  request.stop_strings = {"never appears in this text", stop};
  ASSERT_TRUE((*serving)->Submit(std::move(request)).ok());
  ASSERT_TRUE(collector.WaitFinished(1));
  const Collector::Outcome outcome = collector.Get(0);
  EXPECT_EQ(outcome.text, full.substr(0, first));
  EXPECT_EQ(outcome.last.finish_reason, "stop");
  EXPECT_LT(outcome.last.completion_tokens, 24);
}

TEST_F(ServingEngineTest, FullQueueRefusesThenQueuedRequestsRun) {
  ServingEngineOptions options;
  options.max_queue = 2;
  auto serving = ServingEngine::Create(MakeEngine(1), tokenizer_.get(), options);
  ASSERT_TRUE(serving.ok());
  Collector collector;
  ASSERT_TRUE((*serving)->Submit(Greedy(Encode("a b"), 3, collector.Callback(0))).ok());
  ASSERT_TRUE((*serving)->Submit(Greedy(Encode("c d"), 3, collector.Callback(1))).ok());
  Result<uint64_t> refused = (*serving)->Submit(Greedy(Encode("e f"), 3, collector.Callback(2)));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("limits.max_queue 2"), std::string::npos);
  (*serving)->Start();
  ASSERT_TRUE(collector.WaitFinished(2));
  EXPECT_TRUE(collector.Get(0).last.error.ok());
  EXPECT_TRUE(collector.Get(1).last.error.ok());
}

TEST_F(ServingEngineTest, CancelEndsTheRequestAndReleasesItsKv) {
  MetricsRegistry metrics;
  std::unique_ptr<ServingEngine> serving = StartMetered(metrics, 2);
  ASSERT_NE(serving, nullptr);
  Collector collector;
  Result<uint64_t> id =
      serving->Submit(Greedy(Encode("Once upon a time"), 900, collector.Callback(0)));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(collector.WaitUpdates(0, 1));  // running: it holds KV blocks
  serving->Cancel(*id);
  ASSERT_TRUE(collector.WaitFinished(1));
  const Collector::Outcome cancelled = collector.Get(0);
  EXPECT_EQ(cancelled.last.error.code(), StatusCode::kUnavailable);
  EXPECT_NE(cancelled.last.error.message().find("cancelled"), std::string::npos);
  EXPECT_LT(cancelled.last.completion_tokens, 900);
  // A later request runs, and once idle the KV cache is empty again.
  ASSERT_TRUE(serving->Submit(Greedy(Encode("x"), 2, collector.Callback(1))).ok());
  ASSERT_TRUE(collector.WaitFinished(2));
  serving->Stop();
  const std::string exposition = metrics.ExpositionText();
  EXPECT_NE(exposition.find("rubato:kv_cache_usage_perc{model_name=\"\"} 0\n"), std::string::npos)
      << exposition;
  EXPECT_NE(exposition.find(
                "rubato:request_success_total{model_name=\"\",finished_reason=\"length\"} 1\n"),
            std::string::npos);
}

// A cancel that reaches the engine thread in the same loop turn as its request (the client left
// while a step ran) ends the request there: it never runs, and counts as aborted.
TEST_F(ServingEngineTest, CancelBeforeAdmissionNeverRuns) {
  MetricsRegistry metrics;
  ServingEngineOptions options;
  options.metrics = &metrics;
  auto serving = ServingEngine::Create(MakeEngine(2, &metrics), tokenizer_.get(), options);
  ASSERT_TRUE(serving.ok());
  Collector collector;
  Result<uint64_t> id =
      (*serving)->Submit(Greedy(Encode("Once upon a time"), 900, collector.Callback(0)));
  ASSERT_TRUE(id.ok());
  (*serving)->Cancel(*id);
  (*serving)->Start();  // its first turn sees both
  ASSERT_TRUE(collector.WaitFinished(1));
  const Collector::Outcome cancelled = collector.Get(0);
  EXPECT_EQ(cancelled.updates, 1);
  EXPECT_EQ(cancelled.last.completion_tokens, 0);
  EXPECT_NE(cancelled.last.error.message().find("client went away"), std::string::npos);
  (*serving)->Stop();
  const std::string exposition = metrics.ExpositionText();
  EXPECT_NE(exposition.find("rubato:requests_aborted_total{model_name=\"\"} 1\n"),
            std::string::npos)
      << exposition;
  EXPECT_NE(exposition.find("rubato:generation_tokens_total{model_name=\"\"} 0\n"),
            std::string::npos)
      << exposition;
}

// Draining: new requests are refused and Health says why, while the running one finishes; Stop
// then gives its reason to the requests it ends.
TEST_F(ServingEngineTest, DrainRefusesNewRequestsAndStopNamesItsReason) {
  auto serving = ServingEngine::Create(MakeEngine(2), tokenizer_.get(), {});
  ASSERT_TRUE(serving.ok());
  (*serving)->Start();
  Collector collector;
  ASSERT_TRUE((*serving)->Submit(Greedy(Encode("a b"), 6, collector.Callback(0))).ok());
  ASSERT_TRUE((*serving)->Submit(Greedy(Encode("c d"), 900, collector.Callback(1))).ok());
  ASSERT_TRUE(collector.WaitUpdates(1, 1));
  (*serving)->Drain();
  EXPECT_EQ((*serving)->Health().code(), StatusCode::kUnavailable);
  EXPECT_NE((*serving)->Health().message().find("shutting down"), std::string::npos);
  Result<uint64_t> late = (*serving)->Submit(Greedy(Encode("e"), 2, collector.Callback(2)));
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable);
  ASSERT_TRUE(collector.WaitFinished(1));
  EXPECT_TRUE(collector.Get(0).last.error.ok());
  (*serving)->Stop(UnavailableError("the server is shutting down: grace over"));
  ASSERT_TRUE(collector.WaitFinished(2));
  EXPECT_EQ(collector.Get(1).last.error.message(), "the server is shutting down: grace over");
}

TEST_F(ServingEngineTest, EngineCancelReleasesWaitingAndRunningRequests) {
  std::unique_ptr<Engine> engine = MakeEngine(1);
  const int free_before = engine->kv_cache().free_blocks();
  GenerationRequest request;
  request.prompt_ids = Encode("Once upon a time");
  request.max_new_tokens = 100;
  Result<uint64_t> running = engine->Submit(request);
  Result<uint64_t> waiting = engine->Submit(request);
  ASSERT_TRUE(running.ok() && waiting.ok());
  ASSERT_TRUE(engine->Step().ok());
  ASSERT_EQ(engine->num_running(), 1);
  ASSERT_EQ(engine->num_waiting(), 1);
  EXPECT_LT(engine->kv_cache().free_blocks(), free_before);
  EXPECT_TRUE(engine->Cancel(*waiting).ok());
  EXPECT_EQ(engine->num_waiting(), 0);
  EXPECT_TRUE(engine->Cancel(*running).ok());
  EXPECT_EQ(engine->num_running(), 0);
  EXPECT_EQ(engine->kv_cache().free_blocks(), free_before);
  EXPECT_FALSE(engine->HasWork());
  EXPECT_EQ(engine->Cancel(*running).code(), StatusCode::kNotFound);
  EXPECT_EQ(engine->Cancel(12345).code(), StatusCode::kNotFound);
}

TEST_F(ServingEngineTest, EngineRefusalIsRejected) {
  auto serving = ServingEngine::Create(MakeEngine(1), tokenizer_.get(), {});
  ASSERT_TRUE(serving.ok());
  (*serving)->Start();
  Collector collector;
  ServingRequest bad = Greedy({1, 2}, 4, collector.Callback(0));
  bad.generation.sampling.top_p = 0.f;
  ASSERT_TRUE((*serving)->Submit(std::move(bad)).ok());
  ASSERT_TRUE(collector.WaitFinished(1));
  const ServingUpdate last = collector.Get(0).last;
  EXPECT_TRUE(last.rejected);
  EXPECT_EQ(last.error.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(last.error.message().find("top_p"), std::string::npos);
}

TEST_F(ServingEngineTest, RequestTimeoutEndsTheRequest) {
  MetricsRegistry metrics;
  ServingEngineOptions options;
  options.request_timeout_s = 0.05;
  options.metrics = &metrics;
  auto serving = ServingEngine::Create(MakeEngine(1, &metrics), tokenizer_.get(), options);
  ASSERT_TRUE(serving.ok());
  (*serving)->Start();
  Collector collector;
  ASSERT_TRUE((*serving)->Submit(Greedy(Encode("Once"), 1000, collector.Callback(0))).ok());
  ASSERT_TRUE(collector.WaitFinished(1));
  const ServingUpdate last = collector.Get(0).last;
  EXPECT_EQ(last.error.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(last.error.message().find("limits.request_timeout_s"), std::string::npos);
  (*serving)->Stop();
  EXPECT_NE(metrics.ExpositionText().find("rubato:requests_timed_out_total{model_name=\"\"} 1\n"),
            std::string::npos);
}

TEST_F(ServingEngineTest, StopEndsQueuedRequestsAndRefusesNewOnes) {
  auto serving = ServingEngine::Create(MakeEngine(1), tokenizer_.get(), {});
  ASSERT_TRUE(serving.ok());
  EXPECT_EQ((*serving)->Health().code(), StatusCode::kUnavailable);  // not started
  Collector collector;
  ASSERT_TRUE((*serving)->Submit(Greedy(Encode("a"), 5, collector.Callback(0))).ok());
  (*serving)->Stop();
  ASSERT_TRUE(collector.WaitFinished(1));
  EXPECT_EQ(collector.Get(0).last.error.code(), StatusCode::kUnavailable);
  Result<uint64_t> late = (*serving)->Submit(Greedy(Encode("a"), 5, collector.Callback(1)));
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable);
}

// A request that fails inside the engine (its cache rank is lost) answers 503 through the
// router, and /health says why.
TEST_F(ServingEngineTest, LostCacheRankAnswers503AndHealthSaysWhy) {
  LostCacheRank lost;
  auto serving = ServingEngine::Create(MakeEngine(1, nullptr, &lost), tokenizer_.get(), {});
  ASSERT_TRUE(serving.ok());
  (*serving)->Start();
  OpenAiRouter router(serving->get(), tokenizer_.get(), nullptr, {"tiny", 0});
  const HttpReply reply =
      router.Handle({"POST", "/v1/completions", R"({"prompt": "Once upon", "max_tokens": 4})"});
  ASSERT_NE(reply.pending, nullptr);
  PendingReply::Progress progress;
  for (int i = 0; i < 400 && !progress.complete; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    progress = reply.pending->Take();
  }
  ASSERT_TRUE(progress.complete);
  EXPECT_EQ(progress.status, 503);
  EXPECT_NE(progress.body.find("stopped answering"), std::string::npos) << progress.body;
  HttpReply health;
  for (int i = 0; i < 400 && health.status != 503; ++i) {
    health = router.Handle({"GET", "/health", ""});
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(health.status, 503);
  EXPECT_NE(health.body.find("stopped answering"), std::string::npos) << health.body;
}

// A request whose KV does not fit the cache rank's budget fails alone: 507 for it, /health stays
// 200 for everyone (it used to turn 503 until a later request succeeded).
TEST_F(ServingEngineTest, ARequestThatDoesNotFitFailsAloneAndHealthStaysUp) {
  FullCacheRank full;
  auto serving = ServingEngine::Create(MakeEngine(1, nullptr, &full), tokenizer_.get(), {});
  ASSERT_TRUE(serving.ok());
  (*serving)->Start();
  OpenAiRouter router(serving->get(), tokenizer_.get(), nullptr, {"tiny", 0});
  for (int attempt = 0; attempt < 2; ++attempt) {
    const HttpReply reply =
        router.Handle({"POST", "/v1/completions", R"({"prompt": "Once upon", "max_tokens": 4})"});
    ASSERT_NE(reply.pending, nullptr);
    PendingReply::Progress progress;
    for (int i = 0; i < 3000 && !progress.complete; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      progress = reply.pending->Take();
    }
    ASSERT_TRUE(progress.complete);
    EXPECT_EQ(progress.status, 507) << progress.body;
    EXPECT_NE(progress.body.find("kv_budget_exhausted"), std::string::npos) << progress.body;
    const HttpReply health = router.Handle({"GET", "/health", ""});
    EXPECT_EQ(health.status, 200) << health.body;
  }
}

// Through the router, whose request workers prepare a request before the engine sees it: a
// client that leaves at once is counted aborted exactly once, whether its cancel comes while the
// request waits for a worker, while it is tokenized or once it is in the engine.
TEST_F(ServingEngineTest, ClientsLeavingDuringPreparationCountAbortedOnce) {
  MetricsRegistry metrics;
  std::unique_ptr<ServingEngine> serving = StartMetered(metrics, 2);
  ASSERT_NE(serving, nullptr);
  constexpr int kRequests = 12;
  const std::string aborted = "rubato:requests_aborted_total{model_name=\"\"} " +
                              std::to_string(kRequests) + "\n";
  {
    OpenAiRouter router(serving.get(), tokenizer_.get(), nullptr, {"tiny", 0, {}, 1, 64});
    for (int i = 0; i < kRequests; ++i) {
      const HttpReply reply = router.Handle(
          {"POST", "/v1/completions",
           R"({"prompt": "Once upon a time", "max_tokens": 900, "temperature": 0})"});
      ASSERT_NE(reply.pending, nullptr);
      // Later and later: before the worker took it, while it works, once it is submitted.
      std::this_thread::sleep_for(std::chrono::microseconds(300 * (i % 4)));
      reply.pending->Cancel();
    }
    for (int i = 0; i < 2000 && metrics.ExpositionText().find(aborted) == std::string::npos; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  const std::string exposition = metrics.ExpositionText();
  EXPECT_NE(exposition.find(aborted), std::string::npos) << exposition;
  for (const char* reason : {"stop", "length"}) {
    EXPECT_NE(exposition.find("rubato:request_success_total{model_name=\"\",finished_reason=\"" +
                              std::string(reason) + "\"} 0\n"),
              std::string::npos)
        << exposition;
  }
}

TEST_F(ServingEngineTest, CreateRefusesBadOptions) {
  ServingEngineOptions options;
  options.max_queue = 0;
  auto refused = ServingEngine::Create(MakeEngine(1), tokenizer_.get(), options);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("limits.max_queue"), std::string::npos);
  auto no_tokenizer = ServingEngine::Create(MakeEngine(1), nullptr, {});
  ASSERT_FALSE(no_tokenizer.ok());
  EXPECT_NE(no_tokenizer.status().message().find("tokenizer.json"), std::string::npos);
}

}  // namespace
}  // namespace rubato::server
