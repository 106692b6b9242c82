// Tests for SFI in the engine (the sfi policy, docs/design.md §4.2) on the CPU reference: a budget
// covering the context generates exactly the dense tokens; the schedule's step kinds reach the
// model and the counters (first decode step slow, t_max, triggers); the confidence trigger
// recomputes improbable fast steps as slow ones (same draw, same position); a small budget attends
// less and keeps each request independent of its batch; the model rejects inconsistent SFI entries;
// option validation.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/sfi/sfi_cpu_backend.h"
#include "inference_rank/policies/sfi/sfi_policy.h"

namespace rubato {
namespace {

using engine_test::Prompt;
using engine_test::Sampled;

SfiPolicyConfig SmallSfi(int budget, int t_max) {
  SfiPolicyConfig sfi;
  sfi.sink_tokens = 4;
  sfi.recent_window = 8;
  sfi.t_max = t_max;
  sfi.prefill_window = 4;
  sfi.triggers.clear();
  sfi.selector.budget = budget;
  sfi.selector.nms_window = 4;
  return sfi;
}

struct RunResult {
  std::vector<std::vector<TokenEvent>> events;  // [request] in submission order
  SfiCounters counters;
};

class EngineSfiTest : public ::testing::Test {
 protected:
  std::unique_ptr<Engine> NewEngine(const std::optional<SfiPolicyConfig>& sfi,
                                    std::vector<int> triggers = {}, int max_batch = 4) {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/5);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    EngineOptions options;
    options.max_batch = max_batch;
    options.prefill_chunk = 12;  // prompts arrive in several chunks, mixed with decode tokens
    if (sfi.has_value()) {
      auto policy = SfiPolicy::Create(*sfi);
      EXPECT_TRUE(policy.ok()) << policy.status().ToString();
      if (!policy.ok()) return nullptr;
      EXPECT_TRUE((*policy)->SetTriggerIds(std::move(triggers)).ok());
      options.policy = std::move(policy).value();
    }
    auto engine = Engine::Create(std::move(model).value(), options);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    return engine.ok() ? std::move(engine).value() : nullptr;
  }

  RunResult Run(Engine& engine, const std::vector<GenerationRequest>& requests) {
    std::vector<uint64_t> ids;
    for (const GenerationRequest& r : requests) {
      auto id = engine.Submit(r);
      EXPECT_TRUE(id.ok()) << id.status().ToString();
      ids.push_back(*id);
    }
    std::map<uint64_t, std::vector<TokenEvent>> by_id;
    while (engine.HasWork()) {
      auto step = engine.Step();
      if (!step.ok()) {
        ADD_FAILURE() << step.status().ToString();
        break;
      }
      for (const TokenEvent& event : *step) by_id[event.request_id].push_back(event);
    }
    RunResult result;
    for (uint64_t id : ids) result.events.push_back(by_id[id]);
    const auto* sfi = dynamic_cast<const SfiPolicy*>(engine.options().policy.get());
    if (sfi != nullptr) result.counters = sfi->counters();
    return result;
  }

  static std::vector<std::vector<int>> Tokens(const RunResult& run) {
    std::vector<std::vector<int>> tokens;
    for (const auto& events : run.events) {
      tokens.emplace_back();
      for (const TokenEvent& event : events) tokens.back().push_back(event.token);
    }
    return tokens;
  }

  TestTempDir dir_;
};

TEST_F(EngineSfiTest, BudgetCoveringTheContextGeneratesTheDenseTokens) {
  const std::vector<GenerationRequest> requests = {Sampled(37, 1, 24), Sampled(50, 2, 20),
                                                   Sampled(9, 3, 30)};
  auto dense = NewEngine(std::nullopt);
  auto sfi = NewEngine(SmallSfi(/*budget=*/1000, /*t_max=*/3), /*triggers=*/{5, 40});
  ASSERT_NE(dense, nullptr);
  ASSERT_NE(sfi, nullptr);
  const RunResult dense_run = Run(*dense, requests);
  const RunResult sfi_run = Run(*sfi, requests);
  EXPECT_EQ(Tokens(sfi_run), Tokens(dense_run));
  // Both kinds ran: the tokens are the dense ones through fast steps too.
  EXPECT_GT(sfi_run.counters.slow_steps, 0);
  EXPECT_GT(sfi_run.counters.fast_steps, 0);
  EXPECT_EQ(dense_run.counters.slow_steps + dense_run.counters.fast_steps, 0);
}

TEST_F(EngineSfiTest, ScheduleSetsStepKindsAndRetainedRatio) {
  // The prompt's selection samples token 0; decode step i >= 1 follows t_max = 2 with no
  // triggers: slow, fast, fast, slow, fast, fast, ... (a stop token may end the run early).
  auto engine = NewEngine(SmallSfi(/*budget=*/4, /*t_max=*/2));
  ASSERT_NE(engine, nullptr);
  const RunResult run = Run(*engine, {Sampled(30, 4, 12)});
  ASSERT_EQ(run.events.size(), 1u);
  const std::vector<TokenEvent>& events = run.events[0];
  ASSERT_GE(events.size(), 4u) << "the request stopped too early to test the schedule";
  int64_t slow = 0, fast = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    SCOPED_TRACE("token " + std::to_string(i));
    if (i >= 1 && (i - 1) % 3 != 0) {
      ++fast;
      // sink 4 + selected 4 + recent segment (8 .. 10 positions) of 31+ positions.
      EXPECT_LT(events[i].retained_kv_ratio, 0.75);
      EXPECT_GT(events[i].retained_kv_ratio, 0.3);
    } else {
      ++slow;
      EXPECT_EQ(events[i].retained_kv_ratio, 1.0);
    }
  }
  EXPECT_EQ(run.counters.slow_steps, slow);
  EXPECT_EQ(run.counters.fast_steps, fast);
}

TEST_F(EngineSfiTest, TriggerTokenMakesTheNextStepSlow) {
  // With t_max large, only the first decode step and triggers are slow. Every token a trigger:
  // every decode step is slow; no token a trigger: one slow decode step, the rest fast.
  std::vector<int> all_tokens;
  for (int id = 0; id < 97; ++id) all_tokens.push_back(id);
  auto always = NewEngine(SmallSfi(/*budget=*/4, /*t_max=*/64), all_tokens);
  auto never = NewEngine(SmallSfi(/*budget=*/4, /*t_max=*/64));
  ASSERT_NE(always, nullptr);
  ASSERT_NE(never, nullptr);
  GenerationRequest request = Sampled(30, 6, 8);
  request.stop_token_ids = {};
  const RunResult always_run = Run(*always, {request});
  const RunResult never_run = Run(*never, {request});
  const int64_t tokens = static_cast<int64_t>(always_run.events[0].size());
  ASSERT_GT(tokens, 2);
  EXPECT_EQ(always_run.counters.fast_steps, 0);
  EXPECT_EQ(always_run.counters.slow_steps, tokens);  // the prompt's + every decode step
  EXPECT_EQ(never_run.counters.slow_steps, 2);        // the prompt's + the first decode
  EXPECT_EQ(never_run.counters.fast_steps, static_cast<int64_t>(never_run.events[0].size()) - 2);
}

TEST_F(EngineSfiTest, ConfidenceTriggerRecomputesImprobableFastStepsAsSlowOnes) {
  // A tiny budget attends too little to reproduce the dense tokens; with a confidence threshold
  // no token of the random tiny model reaches, every fast step is thrown away and recomputed by
  // a slow (dense) step at the same position with the same draw: exactly the dense tokens, in a
  // batch, sampled at temperature 1.
  const std::vector<GenerationRequest> requests = {Sampled(37, 1, 16), Sampled(50, 2, 12),
                                                   Sampled(29, 3, 20)};
  SfiPolicyConfig sparse = SmallSfi(/*budget=*/2, /*t_max=*/64);
  SfiPolicyConfig redo = sparse;
  redo.confidence_threshold = 0.999;
  auto dense = NewEngine(std::nullopt);
  auto sparse_engine = NewEngine(sparse);
  auto redo_engine = NewEngine(redo);
  ASSERT_NE(dense, nullptr);
  ASSERT_NE(sparse_engine, nullptr);
  ASSERT_NE(redo_engine, nullptr);
  const RunResult dense_run = Run(*dense, requests);
  const RunResult sparse_run = Run(*sparse_engine, requests);
  const RunResult redo_run = Run(*redo_engine, requests);
  ASSERT_NE(Tokens(sparse_run), Tokens(dense_run)) << "the budget is too large to test anything";
  EXPECT_EQ(sparse_run.counters.discarded_steps, 0);
  EXPECT_EQ(Tokens(redo_run), Tokens(dense_run));
  int64_t tokens = 0;
  for (const auto& events : redo_run.events) {
    tokens += static_cast<int64_t>(events.size());
    for (const TokenEvent& event : events) EXPECT_EQ(event.retained_kv_ratio, 1.0);
  }
  // One slow step per token (the prompt's selection samples the first), and every fast step
  // that ran was discarded: one after each decode slow step but the last token's.
  EXPECT_EQ(redo_run.counters.slow_steps, tokens);
  EXPECT_GT(redo_run.counters.discarded_steps, 0);
  EXPECT_EQ(redo_run.counters.discarded_steps, redo_run.counters.fast_steps);
}

TEST_F(EngineSfiTest, ConfidenceTriggerKeepsConfidentFastSteps) {
  // A threshold below every probability discards nothing: the same tokens and step counts as
  // without the trigger.
  GenerationRequest request = Sampled(40, 5, 16);
  SfiPolicyConfig sparse = SmallSfi(/*budget=*/4, /*t_max=*/3);
  SfiPolicyConfig low = sparse;
  low.confidence_threshold = 1e-30;
  auto off = NewEngine(sparse);
  auto on = NewEngine(low);
  ASSERT_NE(off, nullptr);
  ASSERT_NE(on, nullptr);
  const RunResult off_run = Run(*off, {request});
  const RunResult on_run = Run(*on, {request});
  EXPECT_EQ(Tokens(on_run), Tokens(off_run));
  EXPECT_EQ(on_run.counters.discarded_steps, 0);
  EXPECT_EQ(on_run.counters.fast_steps, off_run.counters.fast_steps);
  EXPECT_GT(on_run.counters.fast_steps, 0);
}

TEST_F(EngineSfiTest, FidelityGuardForcedToFireGivesTheSlowStepTokens) {
  // fidelity_guard 1 fires on every fast step: each is recomputed as a slow (dense) step at the
  // same position with the same draw, so the tokens are the dense ones, in a batch.
  const std::vector<GenerationRequest> requests = {Sampled(37, 1, 16), Sampled(50, 2, 12),
                                                   Sampled(29, 3, 20)};
  SfiPolicyConfig sparse = SmallSfi(/*budget=*/2, /*t_max=*/64);
  SfiPolicyConfig forced = sparse;
  forced.fidelity_guard = 1.0;
  auto dense = NewEngine(std::nullopt);
  auto sparse_engine = NewEngine(sparse);
  auto forced_engine = NewEngine(forced);
  ASSERT_NE(dense, nullptr);
  ASSERT_NE(sparse_engine, nullptr);
  ASSERT_NE(forced_engine, nullptr);
  const RunResult dense_run = Run(*dense, requests);
  const RunResult sparse_run = Run(*sparse_engine, requests);
  const RunResult forced_run = Run(*forced_engine, requests);
  ASSERT_NE(Tokens(sparse_run), Tokens(dense_run)) << "the budget is too large to test anything";
  EXPECT_EQ(Tokens(forced_run), Tokens(dense_run));
  for (const auto& events : forced_run.events) {
    for (const TokenEvent& event : events) EXPECT_EQ(event.retained_kv_ratio, 1.0);
  }
  const auto& policy = dynamic_cast<const SfiPolicy&>(*forced_engine->options().policy);
  EXPECT_GT(policy.guard_counters().firings, 0);
  EXPECT_EQ(policy.guard_counters().firings, forced_run.counters.fast_steps);
  EXPECT_EQ(forced_run.counters.discarded_steps, forced_run.counters.fast_steps);
  EXPECT_NE(policy.StatsLine().find(" sfi_guard_firings_per_100_steps="), std::string::npos)
      << policy.StatsLine();
}

TEST_F(EngineSfiTest, FidelityGuardLeavesTheStepsItDoesNotFireOnUnchanged) {
  // Until the guard first fires, every token and step kind is the unguarded run's; a step on
  // which it fires is recomputed as a slow step (retained ratio 1 where the unguarded run had a
  // fast one). The random tiny model's queries drift fast, so the thresholds are low; at least
  // one of them must fire after some fast steps it let through.
  GenerationRequest request = Sampled(40, 5, 24);
  request.stop_token_ids = {};
  SfiPolicyConfig sparse = SmallSfi(/*budget=*/4, /*t_max=*/64);
  auto off = NewEngine(sparse);
  ASSERT_NE(off, nullptr);
  const RunResult off_run = Run(*off, {request});
  const std::vector<TokenEvent>& a = off_run.events[0];
  bool tested = false;
  for (double threshold : {0.5, 0.3, 0.2, 0.1, 0.05, 0.02}) {
    SCOPED_TRACE("fidelity_guard " + std::to_string(threshold));
    SfiPolicyConfig guarded = sparse;
    guarded.fidelity_guard = threshold;
    auto on = NewEngine(guarded);
    ASSERT_NE(on, nullptr);
    const RunResult on_run = Run(*on, {request});
    const std::vector<TokenEvent>& b = on_run.events[0];
    ASSERT_EQ(a.size(), b.size());
    size_t first_firing = a.size();
    for (size_t i = 0; i < a.size(); ++i) {
      if (b[i].retained_kv_ratio != a[i].retained_kv_ratio) {
        EXPECT_EQ(b[i].retained_kv_ratio, 1.0) << "token " << i;  // a slow step now
        first_firing = i;
        break;
      }
      EXPECT_EQ(b[i].token, a[i].token) << "token " << i;
    }
    const auto& policy = dynamic_cast<const SfiPolicy&>(*on->options().policy);
    EXPECT_EQ(first_firing<a.size(), policy.guard_counters().firings> 0);
    tested = tested || (first_firing > 1 && first_firing < a.size());
  }
  EXPECT_TRUE(tested) << "no threshold fired after letting fast steps through: nothing tested";
}

// Also with the key-norm prior (gamma > 0: the model computes its keys' norms at each slow step).
TEST_F(EngineSfiTest, SmallBudgetKeepsEachRequestIndependentOfItsBatch) {
  const std::vector<GenerationRequest> requests = {Sampled(41, 7, 16), Sampled(23, 8, 16),
                                                   Sampled(60, 9, 12)};
  for (double gamma : {0.0, 1.0}) {
    SfiPolicyConfig sfi = SmallSfi(/*budget=*/6, /*t_max=*/4);
    sfi.selector.gamma = gamma;
    auto batched = NewEngine(sfi);
    ASSERT_NE(batched, nullptr);
    const std::vector<std::vector<int>> together = Tokens(Run(*batched, requests));
    for (size_t r = 0; r < requests.size(); ++r) {
      auto alone = NewEngine(sfi);
      ASSERT_NE(alone, nullptr);
      EXPECT_EQ(Tokens(Run(*alone, {requests[r]}))[0], together[r])
          << "request " << r << ", gamma " << gamma;
    }
  }
}

TEST_F(EngineSfiTest, MetricsRegistryCountsTheSteps) {
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/5);
  ASSERT_TRUE(model.ok());
  MetricsRegistry registry;
  EngineOptions options;
  auto policy = SfiPolicy::Create(SmallSfi(/*budget=*/4, /*t_max=*/2));
  ASSERT_TRUE(policy.ok());
  options.policy = std::move(policy).value();
  options.metrics = &registry;
  auto engine = Engine::Create(std::move(model).value(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const RunResult run = Run(**engine, {Sampled(30, 4, 8)});
  const std::string text = registry.ExpositionText();
  EXPECT_NE(text.find("rubato:slow_steps_total " + std::to_string(run.counters.slow_steps)),
            std::string::npos)
      << text;
  // The metric leaves out the discarded fast steps (none here: no confidence trigger).
  EXPECT_NE(text.find("rubato:fast_steps_total " +
                      std::to_string(run.counters.fast_steps - run.counters.discarded_steps)),
            std::string::npos)
      << text;
  EXPECT_GT(run.counters.fast_steps, 0);
  EXPECT_NE(text.find("rubato:retained_kv_ratio_count "), std::string::npos) << text;
  EXPECT_NE(text.find("rubato:discarded_fast_steps_total 0"), std::string::npos) << text;
}

TEST_F(EngineSfiTest, RejectsBadOptions) {
  // A window besides SFI's own segments: the model refuses the plan.
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/5);
  ASSERT_TRUE(model.ok());
  auto backend = MakeSfiCpuBackend((*model)->config(), SmallSfi(4, 3));
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*model)->SetAttentionBackend(std::move(backend).value()).ok());
  auto cache = (*model)->CreateKvCache(16, 8);
  ASSERT_TRUE(cache.ok());
  const std::vector<int> prompt = Prompt(10, 1);
  KvSequence sequence;
  ForwardResult result;
  SfiSequenceState state;
  const EntryAttention slow = SfiStep(SfiStepKind::kSlow, &state, 1);
  ForwardEntry prefill{&sequence, prompt, 0, LogitsWanted::kLast};
  prefill.attention = &slow;
  const Status windowed = (*model)->Forward({&prefill, 1}, **cache, result, AttentionWindow{4, 16});
  ASSERT_FALSE(windowed.ok());
  EXPECT_NE(windowed.message().find("dense forward window"), std::string::npos)
      << windowed.message();

  auto policy = SfiPolicy::Create(SmallSfi(4, 3));
  ASSERT_TRUE(policy.ok());
  const Status unsorted = (*policy)->SetTriggerIds({9, 3});
  ASSERT_FALSE(unsorted.ok());
  EXPECT_NE(unsorted.message().find("sorted"), std::string::npos);

  SfiPolicyConfig no_fast_steps = SmallSfi(4, 3);
  no_fast_steps.t_max = 0;
  policy = SfiPolicy::Create(no_fast_steps);
  ASSERT_FALSE(policy.ok());
  EXPECT_NE(policy.status().message().find("t_max"), std::string::npos)
      << policy.status().message();
}

TEST_F(EngineSfiTest, ModelRejectsAFastStepWithoutASelection) {
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/5);
  ASSERT_TRUE(model.ok());
  auto cache = (*model)->CreateKvCache(16, 8);
  ASSERT_TRUE(cache.ok());
  const std::vector<int> prompt = Prompt(10, 1);
  KvSequence sequence;
  ForwardResult result;
  ForwardEntry prefill{&sequence, prompt, 0, LogitsWanted::kLast};
  ASSERT_TRUE((*model)->Forward({&prefill, 1}, **cache, result).ok());

  const SfiPolicyConfig config = SmallSfi(4, 3);
  auto backend = MakeSfiCpuBackend((*model)->config(), config);
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*model)->SetAttentionBackend(std::move(backend).value()).ok());
  SfiSequenceState state;
  const EntryAttention fast = SfiStep(SfiStepKind::kFast, &state, 1);
  const int token = 3;
  ForwardEntry decode{&sequence, std::span<const int>(&token, 1), 10, LogitsWanted::kLast};
  decode.attention = &fast;
  Status status = (*model)->Forward({&decode, 1}, **cache, result);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("before any slow step"), std::string::npos) << status.message();
  EXPECT_EQ(sequence.num_tokens, 10);  // nothing written

  EntryAttention slow = SfiStep(SfiStepKind::kSlow, &state, 2);  // W = 2 > the entry's 1 token
  decode.attention = &slow;
  status = (*model)->Forward({&decode, 1}, **cache, result);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("window of 2"), std::string::npos) << status.message();

  slow.window_queries = 1;
  ASSERT_TRUE((*model)->Forward({&decode, 1}, **cache, result).ok());
  EXPECT_TRUE(state.has_selection);
  EXPECT_EQ(state.anchor, 4);  // max(sink 4, 11 - recent 8) = 4: J = [4, 4) is empty
}

}  // namespace
}  // namespace rubato
