// Tests for LongFlow on the CPU model and engine (evicting KV): with a budget covering the
// context the logits equal dense attention's bit for bit (model, chunked prefill) and the
// engine's sampled tokens equal dense's; a prompt longer than the budget is compressed and every
// decode token evicts, with the counters, stats line and metrics to show it and the paged cache
// empty after prefill; admission reserves the prompt and B (not max_new_tokens), refuses a
// prompt whose prefill cannot be reserved with a clear error and serves on; residency and plan
// errors are refused by name; the positions the backend records per slot name the tokens the
// slots hold.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/longflow/longflow_cpu_backend.h"
#include "inference_rank/policies/longflow/longflow_policy.h"
#include "inference_rank/policies/longflow/longflow_test_steps.h"
#include "inference_rank/residency/evicting/evicting_residency.h"

namespace rubato {
namespace {

LongFlowConfig SmallConfig(int budget) {
  LongFlowConfig config;
  config.budget = budget;
  config.sink_tokens = 4;
  config.snapkv_window = 8;
  config.snapkv_pool_kernel = 3;
  return config;
}

// Prefill in two chunks, then `steps` greedy decode tokens, through Model::Forward; with
// `policy`, on evicting KV as the engine runs it (prompt blocks released after prefill).
std::vector<std::vector<float>> ForwardLogits(const std::filesystem::path& dir,
                                              LongFlowPolicy* policy, int prompt_length,
                                              int steps) {
  auto loaded = LoadTinyModel(TinyModelKind::kQwen3, dir, /*seed=*/3);
  EXPECT_TRUE(loaded.ok());
  std::unique_ptr<CpuModel> model = std::move(loaded).value();
  auto cache = model->CreateKvCache(16, 16).value();
  std::unique_ptr<SlotKvPool> pool;
  std::unique_ptr<PolicyRequest> request;
  SlotKvForward evicting;
  if (policy != nullptr) {
    EXPECT_TRUE(model->SetAttentionBackend(policy->MakeBackend(*model, 1).value()).ok());
    pool = model->CreateSlotKvPool(policy->config().budget, 1).value();
    evicting.pool = pool.get();
    EXPECT_TRUE(pool->Reserve(evicting.arrays).ok());
    request = policy->Admit(KvResidency::kEvicting);
  }
  const std::vector<int> prompt = engine_test::Prompt(prompt_length, 4);
  KvSequence sequence;
  ForwardResult result;
  std::vector<std::vector<float>> logits;
  int next_token = -1;
  for (int start = 0, step = 0; step <= steps; ++step) {
    const ForwardEntry entry =
        longflow_test::StepEntry(sequence, prompt, start, &next_token, request.get(), &evicting);
    step -= entry.logits == LogitsWanted::kNone;  // the first chunk is not a step
    const Status status = model->Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result);
    EXPECT_TRUE(status.ok()) << status.ToString();
    if (!status.ok()) break;
    start += static_cast<int>(entry.tokens.size());
    if (request && start == prompt_length && entry.tokens.size() > 1) {
      EXPECT_TRUE(cache->Release(sequence).ok());  // as the engine does: the prompt is in slots
      sequence.num_tokens = prompt_length;
    }
    if (entry.logits == LogitsWanted::kNone) continue;
    const std::span<const float> last = result.LastLogits(0);
    logits.emplace_back(last.begin(), last.end());
    next_token = ArgMax(last);
    if (request) request->Observe(start > prompt_length, next_token, -1.f);
  }
  return logits;
}

TEST(LongFlowModel, BudgetCoveringTheContextEqualsDenseBitForBit) {
  TestTempDir dir("longflow");
  const auto dense = ForwardLogits(dir.path(), nullptr, 30, 20);
  // 30 + 20 positions fed back: B = 50 fills the last slot on the last step (the fused op then
  // only chooses the next slot); B = 64 never fills.
  for (int budget : {50, 64}) {
    LongFlowPolicy policy(SmallConfig(budget));
    const auto longflow = ForwardLogits(dir.path(), &policy, 30, 20);
    ASSERT_EQ(longflow.size(), dense.size());
    for (size_t step = 0; step < dense.size(); ++step) {
      ASSERT_EQ(longflow[step].size(), dense[step].size());
      EXPECT_EQ(std::memcmp(longflow[step].data(), dense[step].data(),
                            dense[step].size() * sizeof(float)),
                0)
          << "budget " << budget << ", step " << step;
    }
    EXPECT_EQ(policy.counters().evictions, 0);
    EXPECT_EQ(policy.counters().prompt_evictions, 0);
  }
}

// The positions the backend records per slot (for rubato_fidelity) name the tokens the slots
// hold. Both runs are fed the same tokens: after the prompt's compression every layer's slot keys
// equal the dense run's keys at the recorded positions, and after each decode step layer 0's do
// (deeper keys depend on what was evicted); every valid slot has a position, each once, the
// sinks and the latest token among them, and no invalid slot has one.
TEST(LongFlowModel, SlotPositionsNameTheTokensTheSlotsHold) {
  TestTempDir dir("longflow");
  const int prompt_length = 40, steps = 20, budget = 24;
  const std::vector<int> tokens = engine_test::Prompt(prompt_length + steps, 4);
  const std::span<const int> prompt = std::span<const int>(tokens).first(prompt_length);
  auto dense_model = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), /*seed=*/3).value();
  auto dense_cache = dense_model->CreateKvCache(16, 16).value();
  KvSequence dense_sequence;
  ForwardResult result;
  for (int start = 0; start < prompt_length + steps;) {
    const ForwardEntry entry =
        longflow_test::StepEntry(dense_sequence, prompt, start, &tokens[start], nullptr, nullptr);
    ASSERT_TRUE(
        dense_model->Forward(std::span<const ForwardEntry>(&entry, 1), *dense_cache, result).ok());
    start += static_cast<int>(entry.tokens.size());
  }
  const ModelConfig& config = dense_model->config();
  const int head_dim = config.head_dim, kv_heads = config.num_kv_heads;

  LongFlowPolicy policy(SmallConfig(budget));
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), /*seed=*/3).value();
  ASSERT_TRUE(model->SetAttentionBackend(policy.MakeBackend(*model, 1).value()).ok());
  auto cache = model->CreateKvCache(16, 16).value();
  auto pool = model->CreateSlotKvPool(budget, 1).value();
  SlotKvForward evicting{pool.get(), {}};
  ASSERT_TRUE(pool->Reserve(evicting.arrays).ok());
  std::unique_ptr<PolicyRequest> request = policy.Admit(KvResidency::kEvicting);
  KvSequence sequence;
  int checked_keys = 0;
  const LongFlowRequestState* state = nullptr;
  for (int start = 0; start < prompt_length + steps;) {
    const ForwardEntry entry =
        longflow_test::StepEntry(sequence, prompt, start, &tokens[start], request.get(), &evicting);
    ASSERT_TRUE(model->Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result).ok());
    start += static_cast<int>(entry.tokens.size());
    if (start < prompt_length) continue;
    if (entry.tokens.size() > 1) {
      ASSERT_TRUE(cache->Release(sequence).ok());
      sequence.num_tokens = prompt_length;
    }
    state = static_cast<const LongFlowRequestState*>(entry.attention->state);
    ASSERT_EQ(state->slot_positions.size(),
              static_cast<size_t>(config.num_layers) * kv_heads * budget);
    const int layers_to_compare = entry.tokens.size() > 1 ? config.num_layers : 1;
    for (int layer = 0; layer < config.num_layers; ++layer) {
      const SlotKvView slots = pool->LayerView(layer, evicting.arrays);
      const PagedKvView dense = dense_cache->LayerView(layer, dense_sequence);
      for (int h = 0; h < kv_heads; ++h) {
        const int32_t* positions =
            state->slot_positions.data() + (static_cast<size_t>(layer) * kv_heads + h) * budget;
        std::vector<int> seen(static_cast<size_t>(start), 0);
        for (int slot = 0; slot < budget; ++slot) {
          const int p = positions[slot];
          ASSERT_EQ(p >= 0, slots.valid[slot] != 0) << "layer " << layer << " slot " << slot;
          if (p < 0) continue;
          ASSERT_LT(p, start);
          EXPECT_EQ(++seen[static_cast<size_t>(p)], 1) << "position " << p << " held twice";
          if (layer < layers_to_compare) {
            EXPECT_EQ(std::memcmp(slots.Key(h, slot), dense.keys + dense.Offset(p, h),
                                  static_cast<size_t>(head_dim) * sizeof(float)),
                      0)
                << "layer " << layer << ", head " << h << ", slot " << slot << ", position " << p
                << ", context " << start;
            ++checked_keys;
          }
        }
        for (int p = 0; p < 4; ++p) EXPECT_EQ(seen[static_cast<size_t>(p)], 1) << "sink " << p;
        EXPECT_EQ(seen[static_cast<size_t>(start - 1)], 1) << "the latest token, " << start - 1;
      }
    }
  }
  // The prompt's move in every layer and head, then one layer a step; every slot full.
  EXPECT_EQ(checked_keys, (config.num_layers + steps) * kv_heads * budget);
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->evictions, steps * config.num_layers * kv_heads);  // every step evicted
}

struct EngineRun {
  std::map<uint64_t, std::vector<TokenEvent>> events;
  // The paged blocks held at steps that produced tokens: for one request, from the end of its
  // prefill on (decode tokens never touch the paged cache).
  int max_used_blocks_after_prefill = 0;
};

EngineRun RunEngine(Engine& engine, const std::vector<GenerationRequest>& requests) {
  EngineRun run;
  for (const GenerationRequest& request : requests) {
    auto id = engine.Submit(request);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
  }
  while (engine.HasWork()) {
    auto events = engine.Step();
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) run.events[event.request_id].push_back(event);
    if (!events->empty()) {
      run.max_used_blocks_after_prefill =
          std::max(run.max_used_blocks_after_prefill, engine.kv_cache().used_blocks());
    }
  }
  return run;
}

std::unique_ptr<Engine> MakeEngine(const std::filesystem::path& dir,
                                   std::shared_ptr<AttentionPolicy> policy, KvResidency residency,
                                   int max_kv_blocks = 0, MetricsRegistry* metrics = nullptr) {
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir, /*seed=*/5);
  EXPECT_TRUE(model.ok());
  EngineOptions options;
  options.max_batch = 2;
  options.prefill_chunk = 32;
  options.policy = std::move(policy);
  if (residency == KvResidency::kEvicting)
    options.residency = std::make_shared<EvictingResidency>();
  options.max_kv_blocks = max_kv_blocks;
  options.metrics = metrics;
  auto engine = Engine::Create(std::move(model).value(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

std::vector<std::vector<int>> Tokens(const EngineRun& run) {
  std::vector<std::vector<int>> tokens;
  for (const auto& [id, events] : run.events) {
    tokens.emplace_back();
    for (const TokenEvent& event : events) tokens.back().push_back(event.token);
  }
  return tokens;
}

TEST(LongFlowEngine, BudgetCoveringTheContextGivesTheDenseTokens) {
  TestTempDir dir("longflow");
  const std::vector<GenerationRequest> requests = {engine_test::Sampled(45, 1, 30),
                                                   engine_test::Sampled(70, 2, 24)};
  auto dense = MakeEngine(dir.path(), nullptr, KvResidency::kLocal);
  const auto dense_tokens = Tokens(RunEngine(*dense, requests));
  auto policy = std::make_shared<LongFlowPolicy>(SmallConfig(128));
  auto engine = MakeEngine(dir.path(), policy, KvResidency::kEvicting);
  const EngineRun run = RunEngine(*engine, requests);
  EXPECT_EQ(Tokens(run), dense_tokens);
  EXPECT_EQ(engine->kv_cache().used_blocks(), 0);
  EXPECT_EQ(policy->counters().evictions, 0);
}

TEST(LongFlowEngine, LongPromptIsCompressedAndEveryDecodeTokenEvicts) {
  TestTempDir dir("longflow");
  auto policy = std::make_shared<LongFlowPolicy>(SmallConfig(24));
  MetricsRegistry metrics;
  auto engine = MakeEngine(dir.path(), policy, KvResidency::kEvicting, 0, &metrics);
  const EngineRun run = RunEngine(*engine, {engine_test::Sampled(40, 3, 30)});
  ASSERT_EQ(run.events.size(), 1u);
  const std::vector<TokenEvent>& events = run.events.begin()->second;
  ASSERT_FALSE(events.empty());
  EXPECT_NE(events.back().finish, FinishReason::kError);
  ASSERT_GT(events.size(), 10u);  // decode steps to evict (seeded: no early stop token)
  const int layers = 2, kv_heads = 2;
  const int64_t decode_steps = static_cast<int64_t>(events.size()) - 1;  // the first: prefill
  EXPECT_EQ(policy->counters().prompt_evictions, (40 - 24) * layers * kv_heads);
  EXPECT_EQ(policy->counters().evictions, decode_steps * layers * kv_heads);
  EXPECT_DOUBLE_EQ(policy->counters().last_occupancy, 1.0);
  EXPECT_EQ(run.max_used_blocks_after_prefill, 0);
  for (const TokenEvent& event : events) {  // 24 slots of a context of 40 and more
    EXPECT_LE(event.retained_kv_ratio, 24.0 / 40.0);
  }
  const std::string stats = policy->StatsLine();
  EXPECT_NE(stats.find("longflow_evictions=" + std::to_string(decode_steps * 4)), std::string::npos)
      << stats;
  EXPECT_NE(stats.find("longflow_prompt_evictions=64"), std::string::npos) << stats;
  EXPECT_NE(stats.find("longflow_budget_occupancy=1.000"), std::string::npos) << stats;
  const std::string exposition = metrics.ExpositionText();
  EXPECT_NE(exposition.find("rubato:longflow_evictions_total " + std::to_string(decode_steps * 4)),
            std::string::npos)
      << exposition;
  EXPECT_NE(exposition.find("rubato:longflow_budget_occupancy 1"), std::string::npos);
  const auto& evicting = static_cast<const EvictingResidency&>(*engine->options().residency);
  EXPECT_EQ(evicting.pool()->free_arrays(), 2);  // handed back
  EXPECT_EQ(engine->kv_cache().used_blocks(), 0);
}

TEST(LongFlowEngine, AdmissionReservesThePromptAndTheBudgetAndServesOn) {
  TestTempDir dir("longflow");
  auto policy = std::make_shared<LongFlowPolicy>(SmallConfig(24));
  // 4 blocks of 16: a 40-token prompt prefills, then the request runs on its 24 slots alone.
  auto engine = MakeEngine(dir.path(), policy, KvResidency::kEvicting, /*max_kv_blocks=*/4);
  GenerationRequest long_output = engine_test::Sampled(40, 5, 100);
  long_output.stop_token_ids = {96};
  auto accepted = engine->Submit(long_output);  // 139 positions would need 9 blocks locally
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  auto refused = engine->Submit(engine_test::Sampled(80, 6, 4));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find(
                "prompt (80 tokens) prefills through 5 KV blocks but the cache has 4"),
            std::string::npos)
      << refused.status().message();
  const EngineRun run = RunEngine(*engine, {});
  ASSERT_EQ(run.events.size(), 1u);
  const std::vector<TokenEvent>& events = run.events.begin()->second;
  EXPECT_NE(events.back().finish, FinishReason::kError);
  EXPECT_GT(events.size(), 30u);  // 40 + 30 positions: more than the 64 the cache holds
  if (events.back().finish == FinishReason::kLength) {
    EXPECT_EQ(events.size(), 100u);
  }
  EXPECT_EQ(run.max_used_blocks_after_prefill, 0);

  // The local residency with the same cache refuses the long output outright.
  auto local = MakeEngine(dir.path(), nullptr, KvResidency::kLocal, /*max_kv_blocks=*/4);
  EXPECT_EQ(local->Submit(long_output).status().code(), StatusCode::kResourceExhausted);
}

TEST(LongFlowEngine, ResidencyAndPlanErrorsAreRefusedByName) {
  TestTempDir dir("longflow");
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 5).value();
  EngineOptions options;
  options.residency = std::make_shared<EvictingResidency>();  // no policy: dense
  auto dense = Engine::Create(std::move(model), options);
  ASSERT_FALSE(dense.ok());
  EXPECT_EQ(dense.status().message(),
            "engine: evicting KV needs a policy that supports it (none given: dense attention)");

  options.policy = std::make_shared<LongFlowPolicy>(SmallConfig(24));
  options.residency = nullptr;  // local
  auto local = Engine::Create(LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 5).value(), options);
  ASSERT_FALSE(local.ok());
  EXPECT_EQ(local.status().message(),
            "engine: policy 'longflow' does not support local KV (supported: evicting)");

  // A fixed-budget plan without slots, or of two tokens, is refused by the model.
  auto cpu = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 5).value();
  ASSERT_TRUE(cpu->SetAttentionBackend(options.policy->MakeBackend(*cpu, 1).value()).ok());
  auto cache = cpu->CreateKvCache(16, 4).value();
  KvSequence sequence;
  const std::vector<int> tokens = {1, 2};
  EntryAttention plan;
  plan.action.op = AttentionOp::kFixedBudget;
  ForwardEntry entry{&sequence, std::span<const int>(tokens).first(1), 0};
  entry.attention = &plan;
  ForwardResult result;
  Status status = cpu->Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result);
  EXPECT_NE(status.message().find("fixed-budget attention needs the entry's slot arrays"),
            std::string::npos)
      << status.message();
  auto pool = cpu->CreateSlotKvPool(24, 1).value();
  SlotKvForward evicting{pool.get(), {}};
  ASSERT_TRUE(pool->Reserve(evicting.arrays).ok());
  entry.slots = &evicting;
  entry.tokens = tokens;
  status = cpu->Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result);
  EXPECT_NE(status.message().find("fixed-budget attention takes one token, got 2"),
            std::string::npos)
      << status.message();
}

}  // namespace
}  // namespace rubato
