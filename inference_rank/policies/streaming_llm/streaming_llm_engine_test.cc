// Tests for the engine under the StreamingLLM policy (its forward window, sink + recent): the
// retained-KV ratio of every token event, that a window
// covering the context generates the dense tokens, that a small window gives each request of a
// mixed batch the tokens it gets alone, and option validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/streaming_llm/streaming_llm_policy.h"

namespace rubato {
namespace {

using engine_test::Prompt;
using engine_test::Sampled;

class EngineWindowTest : public ::testing::Test {
 protected:
  std::unique_ptr<Engine> NewEngine(const AttentionWindow& window, int max_batch = 4) {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/5);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    EngineOptions options;
    options.max_batch = max_batch;
    options.prefill_chunk = 12;  // prompts arrive in several chunks, mixed with decode tokens
    options.policy = std::make_shared<StreamingLlmPolicy>(window);
    auto engine = Engine::Create(std::move(model).value(), options);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    return std::move(engine).value();
  }

  // Submits `requests` to one engine and steps it to completion: every event, by request.
  std::map<uint64_t, std::vector<TokenEvent>> Run(Engine& engine,
                                                  const std::vector<GenerationRequest>& requests,
                                                  std::vector<uint64_t>* ids) {
    for (const GenerationRequest& r : requests) {
      auto id = engine.Submit(r);
      EXPECT_TRUE(id.ok()) << id.status().ToString();
      ids->push_back(*id);
    }
    std::map<uint64_t, std::vector<TokenEvent>> events;
    while (engine.HasWork()) {
      auto step = engine.Step();
      if (!step.ok()) {
        ADD_FAILURE() << step.status().ToString();
        break;
      }
      for (const TokenEvent& event : *step) events[event.request_id].push_back(event);
    }
    return events;
  }

  std::vector<std::vector<int>> Tokens(const AttentionWindow& window,
                                       const std::vector<GenerationRequest>& requests,
                                       int max_batch) {
    auto engine = NewEngine(window, max_batch);
    std::vector<uint64_t> ids;
    auto events = Run(*engine, requests, &ids);
    std::vector<std::vector<int>> tokens;
    for (uint64_t id : ids) {
      tokens.emplace_back();
      for (const TokenEvent& event : events[id]) tokens.back().push_back(event.token);
    }
    return tokens;
  }

  TestTempDir dir_{"engine_window"};
};

TEST(RetainedKvRatio, DenseIsOneStreamingIsWindowOverContext) {
  EXPECT_EQ(RetainedKvRatio(AttentionWindow(), 1), 1.0);
  EXPECT_EQ(RetainedKvRatio(AttentionWindow(), 5003), 1.0);
  const AttentionWindow streaming{4, 256};
  EXPECT_EQ(RetainedKvRatio(streaming, 100), 1.0);
  EXPECT_EQ(RetainedKvRatio(streaming, 260), 1.0);
  EXPECT_DOUBLE_EQ(RetainedKvRatio(streaming, 261), 260.0 / 261.0);
  EXPECT_DOUBLE_EQ(RetainedKvRatio(streaming, 5003), 260.0 / 5003.0);
  EXPECT_DOUBLE_EQ(RetainedKvRatio(AttentionWindow{0, 1}, 40), 1.0 / 40.0);
}

TEST_F(EngineWindowTest, EveryEventReportsTheShareItsQueryAttended) {
  const std::vector<GenerationRequest> requests = {Sampled(10, 1, 25), Sampled(31, 2, 6)};
  for (const AttentionWindow window : {AttentionWindow(), AttentionWindow{4, 16}}) {
    auto engine = NewEngine(window);
    std::vector<uint64_t> ids;
    auto events = Run(*engine, requests, &ids);
    for (size_t r = 0; r < requests.size(); ++r) {
      const std::vector<TokenEvent>& request_events = events[ids[r]];
      ASSERT_FALSE(request_events.empty());
      EXPECT_NE(request_events.back().finish, FinishReason::kNone);
      const int prompt = static_cast<int>(requests[r].prompt_ids.size());
      for (size_t i = 0; i < request_events.size(); ++i) {
        // Event i comes from the query at position prompt - 1 + i: context prompt + i.
        const int context = prompt + static_cast<int>(i);
        const double expected =
            window.IsDense() ? 1.0 : std::min(20, context) / static_cast<double>(context);
        EXPECT_DOUBLE_EQ(request_events[i].retained_kv_ratio, expected)
            << "request " << r << " event " << i << " sink " << window.sink_tokens;
      }
    }
  }
}

TEST_F(EngineWindowTest, WindowCoveringTheContextGeneratesTheDenseTokens) {
  // Longest context: 41 + 20 = 61 < 4 + 60.
  const std::vector<GenerationRequest> requests = {Sampled(30, 3, 20), Sampled(17, 4, 20),
                                                   Sampled(41, 5, 20)};
  const auto dense = Tokens(AttentionWindow(), requests, 4);
  EXPECT_EQ(Tokens(AttentionWindow{4, 60}, requests, 4), dense);
  EXPECT_EQ(Tokens(AttentionWindow{64, 1}, requests, 4), dense);
}

TEST_F(EngineWindowTest, SmallWindowBatchedEqualsAlone) {
  const std::vector<GenerationRequest> requests = {Sampled(30, 6, 15), Sampled(17, 7, 15),
                                                   Sampled(41, 8, 15)};
  const AttentionWindow window{2, 8};
  const auto batched = Tokens(window, requests, 4);
  for (size_t r = 0; r < requests.size(); ++r) {
    EXPECT_EQ(Tokens(window, {requests[r]}, 1)[0], batched[r]) << "request " << r;
  }
  EXPECT_NE(batched, Tokens(AttentionWindow(), requests, 4)) << "a 2+8 window changed nothing";
}

TEST_F(EngineWindowTest, CreateRejectsInvalidWindows) {
  for (const AttentionWindow window : {AttentionWindow{-1, 4}, AttentionWindow{4, 0}}) {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path());
    ASSERT_TRUE(model.ok());
    EngineOptions options;
    options.policy = std::make_shared<StreamingLlmPolicy>(window);
    auto engine = Engine::Create(std::move(model).value(), options);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("sink_tokens must be >= 0 and recent_tokens >= 1"),
              std::string::npos)
        << engine.status().message();
  }
}

}  // namespace
}  // namespace rubato
