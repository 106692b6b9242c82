// SyncKV on the CPU engine (split_by_head KV): with Mem% = 100 % the sets cover the context and
// the tokens equal dense; at 30 % the anticipation and suspension steps and the fetch counters
// show, and a fetch that arrives late (deferred to the step that reads it, or delayed on its
// thread) gives the same tokens as one that arrives at once; the policy needs split_by_head and
// a calibration of the model's shape, and its config is refused by name.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/engine/engine_test_requests.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/policy_registry.h"
#include "inference_rank/policies/synckv/synckv_cpu_backend.h"
#include "inference_rank/policies/synckv/synckv_policy.h"
#include "inference_rank/residency/split_by_head/split_by_head_residency.h"

namespace rubato {
namespace {

// The tiny Qwen3 test model: 2 layers, 4 query / 2 KV heads of 16.
SyncKvCalibration TinyCalibration() {
  SyncKvCalibration c;
  c.model = "tiny-qwen3 (test)";
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.similarity = {1.0, 0.4, 0.4, 1.0, 1.0, 0.6, 0.6, 1.0};
  EXPECT_TRUE(ClusterCalibration(c, 1).ok());
  return c;
}

std::shared_ptr<SyncKvPolicy> Policy(double mem_percent, int stride) {
  SyncKvConfig config;
  config.calibration = "(in memory)";
  config.mem_percent = mem_percent;
  // The tiny model's R-head is half of its KV: Mem% per NR-head makes 30 % meaningful.
  config.mem_basis = "nr_heads";
  config.stride = stride;
  auto policy = SyncKvPolicy::Create(config, TinyCalibration());
  EXPECT_TRUE(policy.ok()) << policy.status().ToString();
  return std::shared_ptr<SyncKvPolicy>(std::move(policy).value());
}

std::unique_ptr<Engine> MakeEngine(const std::filesystem::path& dir,
                                   std::shared_ptr<AttentionPolicy> policy,
                                   std::shared_ptr<Residency> residency,
                                   MetricsRegistry* metrics = nullptr) {
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir, /*seed=*/5);
  EXPECT_TRUE(model.ok());
  EngineOptions options;
  options.max_batch = 2;
  options.prefill_chunk = 32;
  options.policy = std::move(policy);
  options.residency = std::move(residency);
  options.metrics = metrics;
  auto engine = Engine::Create(std::move(model).value(), options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

std::vector<std::vector<int>> Tokens(Engine& engine,
                                     const std::vector<GenerationRequest>& requests) {
  std::map<uint64_t, std::vector<int>> tokens;
  for (const GenerationRequest& request : requests) EXPECT_TRUE(engine.Submit(request).ok());
  while (engine.HasWork()) {
    auto events = engine.Step();
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      EXPECT_NE(event.finish, FinishReason::kError) << event.error.ToString();
      tokens[event.request_id].push_back(event.token);
    }
  }
  std::vector<std::vector<int>> out;
  for (auto& [id, list] : tokens) out.push_back(std::move(list));
  return out;
}

const std::vector<GenerationRequest>& Requests() {
  static const std::vector<GenerationRequest> requests = {engine_test::Sampled(45, 1, 30),
                                                          engine_test::Sampled(70, 2, 24)};
  return requests;
}

TEST(SyncKvEngine, MemPercent100GivesTheDenseTokens) {
  TestTempDir dir("synckv");
  auto dense = MakeEngine(dir.path(), nullptr, nullptr);
  const auto dense_tokens = Tokens(*dense, Requests());
  for (int stride : {1, 5}) {
    auto policy = Policy(100.0, stride);
    auto residency = std::make_shared<SplitByHeadResidency>();
    auto engine = MakeEngine(dir.path(), policy, residency);
    ASSERT_NE(engine, nullptr);
    EXPECT_EQ(Tokens(*engine, Requests()), dense_tokens) << "stride " << stride;
    EXPECT_GT(policy->counters().anticipation_steps, 0);
    EXPECT_GT(residency->counters().rows_offloaded, 0);
    EXPECT_EQ(residency->counters().local_kv_bytes, residency->counters().full_kv_bytes)
        << "every position local at 100 %";
  }
}

TEST(SyncKvEngine, ALateFetchChangesNoToken) {
  TestTempDir dir("synckv");
  std::vector<std::vector<std::vector<int>>> runs;
  std::vector<std::shared_ptr<SplitByHeadResidency>> residencies = {
      std::make_shared<SplitByHeadResidency>(MakeThreadKvFetcher()),
      std::make_shared<SplitByHeadResidency>(MakeDeferredKvFetcher()),
      std::make_shared<SplitByHeadResidency>(MakeThreadKvFetcher(std::chrono::milliseconds(5)))};
  std::shared_ptr<SyncKvPolicy> last_policy;
  MetricsRegistry metrics;
  ASSERT_TRUE(residencies[0]->RegisterMetrics(metrics).ok());  // as `rubato serve` does
  for (size_t i = 0; i < residencies.size(); ++i) {
    auto policy = Policy(30.0, 5);
    auto engine = MakeEngine(dir.path(), policy, residencies[i], i == 0 ? &metrics : nullptr);
    ASSERT_NE(engine, nullptr);
    runs.push_back(Tokens(*engine, Requests()));
    last_policy = policy;
  }
  auto dense = MakeEngine(dir.path(), nullptr, nullptr);
  EXPECT_NE(Tokens(*dense, Requests()), runs[0]) << "at 30 % the sets change the tokens";
  EXPECT_EQ(runs[1], runs[0]) << "fetches deferred to the step that reads them";
  EXPECT_EQ(runs[2], runs[0]) << "fetches delayed on their thread";
  // A request of n tokens decodes n - 1 steps; anticipations at its steps 5, 10, ...
  int64_t anticipations = 0, steps = 0;
  for (const std::vector<int>& tokens : runs[0]) {
    steps += static_cast<int64_t>(tokens.size()) - 1;
    anticipations += (static_cast<int64_t>(tokens.size()) - 1) / 5;
  }
  ASSERT_GT(anticipations, 2);
  EXPECT_EQ(last_policy->counters().anticipation_steps, anticipations);
  EXPECT_EQ(last_policy->counters().suspension_steps, steps - anticipations);
  const SplitByHeadCounters& counters = residencies[0]->counters();
  EXPECT_EQ(counters.fetches, anticipations * 2);  // per layer
  EXPECT_GT(counters.rows_fetched, 0);
  EXPECT_GT(counters.rows_reused, 0) << "the delta: rows already local are not fetched";
  EXPECT_EQ(counters.bytes_fetched, counters.rows_fetched * 2 * 16 * 4);
  EXPECT_LT(counters.local_kv_bytes, counters.full_kv_bytes);
  const std::string exposition = metrics.ExpositionText();
  EXPECT_NE(
      exposition.find("rubato:synckv_anticipation_steps_total " + std::to_string(anticipations)),
      std::string::npos)
      << exposition;
  EXPECT_NE(exposition.find("rubato:split_by_head_rows_fetched_total " +
                            std::to_string(counters.rows_fetched.load())),
            std::string::npos)
      << exposition;
  EXPECT_NE(residencies[0]->StatsLine().find("split_by_head_fetches=" +
                                             std::to_string(anticipations * 2)),
            std::string::npos);
}

TEST(SyncKvEngine, OtherResidenciesAndModelsAreRefusedByName) {
  TestTempDir dir("synckv");
  auto policy = Policy(30.0, 5);
  EXPECT_EQ(CheckResidency(*policy, KvResidency::kLocal).message(),
            "policy 'synckv' does not support local KV (supported: split_by_head)");
  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 5);
  ASSERT_TRUE(model.ok());
  EngineOptions options;
  options.policy = policy;  // no residency: local
  EXPECT_FALSE(Engine::Create(std::move(model).value(), options).ok());

  SyncKvCalibration other = TinyCalibration();
  other.num_layers = 3;
  other.similarity.insert(other.similarity.end(), {1.0, 0.5, 0.5, 1.0});
  SyncKvConfig config;
  config.calibration = "other.json";
  auto mismatched = SyncKvPolicy::Create(config, other);
  ASSERT_TRUE(mismatched.ok());
  auto reloaded = LoadTinyModel(TinyModelKind::kQwen3, dir.path(), 5);
  ASSERT_TRUE(reloaded.ok());
  const Status shape = (*mismatched)->MakeBackend(**reloaded, 1).status();
  EXPECT_NE(shape.message().find("made for 'tiny-qwen3 (test)' (3 layers"), std::string::npos)
      << shape.message();

  config.mem_basis = "total";
  config.mem_percent = 50;  // the R-head alone is half of the KV
  auto total = SyncKvPolicy::Create(config, TinyCalibration());
  ASSERT_TRUE(total.ok());
  EXPECT_NE((*total)->MakeBackend(**reloaded, 1).status().message().find("policy.mem_percent"),
            std::string::npos);
}

TEST(SyncKvConfig, KeysAreReadAndRefusedByName) {
  auto parse = [](const std::string& yaml) {
    auto config = ParseConfig(yaml, "s.yaml");
    EXPECT_TRUE(config.ok()) << config.status().message();
    return ParseSyncKvConfig(config->policy);
  };
  auto good = parse(
      "policy: {name: synckv, calibration: c.json, representatives: 2, stride: 3, "
      "static_ratio: 0.25, mem_percent: 20, mem_basis: total}\n");
  ASSERT_TRUE(good.ok()) << good.status().message();
  EXPECT_EQ(good->representatives, 2);
  EXPECT_EQ(good->stride, 3);
  EXPECT_EQ(good->static_ratio, 0.25);
  EXPECT_EQ(good->mem_percent, 20.0);
  EXPECT_EQ(good->mem_basis, "total");
  EXPECT_NE(parse("policy: {name: synckv}\n").status().message().find("'calibration'"),
            std::string::npos);
  EXPECT_NE(parse("policy: {name: synckv, calibration: c.json, stride: 0}\n")
                .status()
                .message()
                .find("policy.stride"),
            std::string::npos);
  EXPECT_NE(parse("policy: {name: synckv, calibration: c.json, mem_percent: 0}\n")
                .status()
                .message()
                .find("policy.mem_percent"),
            std::string::npos);
  EXPECT_NE(parse("policy: {name: synckv, calibration: c.json, mem_basis: gpu}\n")
                .status()
                .message()
                .find("policy.mem_basis"),
            std::string::npos);
  EXPECT_NE(parse("policy: {name: synckv, calibration: c.json, budget: 3}\n")
                .status()
                .message()
                .find("policy.budget"),
            std::string::npos);
  SyncKvConfig too_many;
  too_many.representatives = 3;
  EXPECT_NE(SyncKvPolicy::Create(too_many, TinyCalibration())
                .status()
                .message()
                .find("policy.representatives: 3"),
            std::string::npos);
}

TEST(SyncKvTopK, TiesToTheLowerPositionAndExclusions) {
  const std::vector<float> scores = {0.1f, 0.3f, 0.3f, 0.2f, 0.3f};
  EXPECT_EQ(SyncKvTopK(scores, 3, {}), (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(SyncKvTopK(scores, 3, {2}), (std::vector<int>{1, 4, 3}));
  EXPECT_EQ(SyncKvTopK(scores, 9, {0, 1, 2, 3, 4}), (std::vector<int>{}));
}

}  // namespace
}  // namespace rubato
