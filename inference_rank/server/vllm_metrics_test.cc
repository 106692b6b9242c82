// The serving metrics under server.metrics_names: with `vllm`, every series vLLM's example
// Grafana dashboard queries (tests/data/vllm/grafana_series.txt, taken from vLLM's
// grafana.json) is exposed with a model_name label after one finished and one aborted request on
// the bundled tiny model, and aborts count as finished_reason="abort"; with `rubato` no vllm:
// series appears; with `both` each shared series is counted under both names. Requests that
// outgrow a small KV pool count their preemptions, and the pool's size is exported.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "inference_rank/model/cpu_model.h"
#include "inference_rank/server/serving_engine.h"

namespace rubato::server {
namespace {

constexpr const char* kModelDir = "models/tiny-qwen3-longctx";
constexpr const char* kDashboardSeries = "tests/data/vllm/grafana_series.txt";
constexpr auto kWait = std::chrono::seconds(20);  // bound on every wait (ASan on 2 cores)

// (panel title, series name) of the dashboard list.
std::vector<std::pair<std::string, std::string>> DashboardSeries() {
  std::ifstream file(kDashboardSeries);
  EXPECT_TRUE(file.good()) << kDashboardSeries;
  std::vector<std::pair<std::string, std::string>> series;
  std::string line;
  while (std::getline(file, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t tab = line.find('\t');
    EXPECT_NE(tab, std::string::npos) << line;
    if (tab != std::string::npos) series.emplace_back(line.substr(0, tab), line.substr(tab + 1));
  }
  return series;
}

// The value of the sample line that starts with `prefix` (name and labels), or -1.
double SampleValue(const std::string& exposition, const std::string& prefix) {
  std::istringstream lines(exposition);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.starts_with(prefix)) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}

// Counts updates and finished requests; waits are bounded.
class Updates {
 public:
  std::function<void(const ServingUpdate&)> Callback() {
    return [this](const ServingUpdate& update) {
      std::lock_guard<std::mutex> lock(mutex_);
      ++updates_;
      finished_ += update.finished;
      changed_.notify_all();
    };
  }
  bool Wait(int updates, int finished) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, kWait,
                             [&] { return updates_ >= updates && finished_ >= finished; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int updates_ = 0;
  int finished_ = 0;
};

// Runs one request to its end (4 tokens) and aborts a long one after its first token, with the
// serving metrics registered under `names`; returns the exposition.
std::string ServeTwoRequests(MetricNames names) {
  MetricsRegistry metrics;
  Result<std::unique_ptr<CpuModel>> model = CpuModel::Load(kModelDir, ModelLoadOptions{});
  EXPECT_TRUE(model.ok()) << model.status().message();
  if (!model.ok()) return "";
  EngineOptions engine_options;
  engine_options.max_batch = 2;
  engine_options.max_context = 1024;
  engine_options.num_threads = 1;
  engine_options.metrics = &metrics;
  Result<std::unique_ptr<Engine>> engine = Engine::Create(std::move(*model), engine_options);
  EXPECT_TRUE(engine.ok()) << engine.status().message();
  Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::LoadFromDirectory(kModelDir);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().message();
  if (!engine.ok() || !tokenizer.ok()) return "";
  ServingEngineOptions options;
  options.metrics = &metrics;
  options.model_name = "tiny";
  options.metric_names = names;
  auto serving = ServingEngine::Create(std::move(*engine), tokenizer->get(), options);
  EXPECT_TRUE(serving.ok()) << serving.status().message();
  if (!serving.ok()) return "";
  (*serving)->Start();

  const auto request = [&](int max_tokens, Updates& updates) {
    ServingRequest r;
    r.generation.prompt_ids = (*tokenizer)->Encode("Once upon a time", true);
    r.generation.max_new_tokens = max_tokens;
    r.on_update = updates.Callback();
    return r;
  };
  Updates finished;
  EXPECT_TRUE((*serving)->Submit(request(4, finished)).ok());
  EXPECT_TRUE(finished.Wait(1, 1));
  Updates aborted;
  Result<uint64_t> long_one = (*serving)->Submit(request(900, aborted));
  EXPECT_TRUE(long_one.ok());
  EXPECT_TRUE(aborted.Wait(1, 0));  // its first token came
  (*serving)->Cancel(*long_one);    // its client went away
  EXPECT_TRUE(aborted.Wait(2, 1));
  (*serving)->Stop();
  return metrics.ExpositionText();
}

TEST(VllmMetricsTest, EverySeriesOfVllmsDashboardIsExposed) {
  const std::vector<std::pair<std::string, std::string>> series = DashboardSeries();
  std::set<std::string> panels;
  for (const auto& [panel, name] : series) panels.insert(panel);
  ASSERT_EQ(panels.size(), 12u) << "the dashboard has 12 panels";

  const std::string text = ServeTwoRequests(MetricNames::kVllm);
  const std::string labels = "{model_name=\"tiny\",engine=\"0\"";
  for (const auto& [panel, name] : series) {
    EXPECT_NE(text.find("\n" + name + labels), std::string::npos)
        << "panel '" << panel << "' reads " << name << ", which is missing:\n"
        << text;
  }
  // Data, not only series: the finished request and the aborted one.
  const std::string success = "vllm:request_success_total" + labels + ",finished_reason=";
  EXPECT_EQ(SampleValue(text, success + "\"length\"}") + SampleValue(text, success + "\"stop\"}"),
            1);
  EXPECT_EQ(SampleValue(text, success + "\"abort\"}"), 1);
  EXPECT_EQ(SampleValue(text, "vllm:e2e_request_latency_seconds_count" + labels), 1);
  EXPECT_EQ(SampleValue(text, "vllm:request_max_num_generation_tokens_sum" + labels), 4);
  EXPECT_GE(SampleValue(text, "vllm:time_per_output_token_seconds_count" + labels), 3);
  // One observation per engine step; the first step prefilled the prompt and made a token.
  EXPECT_GE(SampleValue(text, "vllm:iteration_tokens_total_count" + labels), 4);
  EXPECT_GT(SampleValue(text, "vllm:iteration_tokens_total_sum" + labels),
            SampleValue(text, "vllm:iteration_tokens_total_count" + labels));
  EXPECT_EQ(SampleValue(text, "vllm:num_preemptions_total" + labels), 0);
  // Series only rubato has keep their names; shared ones are not duplicated under rubato:.
  EXPECT_EQ(SampleValue(text, "rubato:requests_aborted_total{model_name=\"tiny\"}"), 1);
  EXPECT_EQ(text.find("rubato:time_to_first_token_seconds"), std::string::npos);
}

TEST(VllmMetricsTest, RubatoNamesHaveNoVllmSeries) {
  const std::string text = ServeTwoRequests(MetricNames::kRubato);
  EXPECT_EQ(text.find("vllm:"), std::string::npos);
  const std::string model = "{model_name=\"tiny\"";
  EXPECT_EQ(
      SampleValue(text, "rubato:request_success_total" + model + ",finished_reason=\"abort\"}"), 1);
  EXPECT_GE(SampleValue(text, "rubato:iteration_tokens_count" + model), 4);
  EXPECT_GE(SampleValue(text, "rubato:time_per_output_token_seconds_count" + model), 3);
  EXPECT_EQ(SampleValue(text, "rubato:num_preemptions_total" + model), 0);
}

// Four requests of 40 tokens over a pool of 4 blocks (64 tokens): the engine preempts, every
// request still ends, and the counter, the pool's size and its usage say so.
TEST(VllmMetricsTest, PreemptionsAndThePoolSizeAreExported) {
  MetricsRegistry metrics;
  Result<std::unique_ptr<CpuModel>> model = CpuModel::Load(kModelDir, ModelLoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().message();
  EngineOptions engine_options;
  engine_options.max_batch = 4;
  engine_options.max_context = 1024;
  engine_options.max_kv_blocks = 4;
  engine_options.num_threads = 1;
  Result<std::unique_ptr<Engine>> engine = Engine::Create(std::move(*model), engine_options);
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::LoadFromDirectory(kModelDir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().message();
  ServingEngineOptions options;
  options.metrics = &metrics;
  options.model_name = "tiny";
  auto serving = ServingEngine::Create(std::move(*engine), tokenizer->get(), options);
  ASSERT_TRUE(serving.ok()) << serving.status().message();
  Updates finished;
  for (int i = 0; i < 4; ++i) {
    ServingRequest r;
    r.generation.prompt_ids = (*tokenizer)->Encode("Once upon a time", true);
    r.generation.max_new_tokens = 40;
    r.generation.ignore_eos = true;
    r.on_update = finished.Callback();
    ASSERT_TRUE((*serving)->Submit(std::move(r)).ok());
  }
  (*serving)->Start();
  ASSERT_TRUE(finished.Wait(4, 4));
  (*serving)->Stop();
  const std::string text = metrics.ExpositionText();
  const std::string model_label = "{model_name=\"tiny\"}";
  EXPECT_GT(SampleValue(text, "rubato:num_preemptions_total" + model_label), 0) << text;
  EXPECT_EQ(SampleValue(text, "rubato:kv_cache_pool_tokens" + model_label), 64) << text;
  EXPECT_EQ(SampleValue(text, "rubato:kv_cache_usage_perc" + model_label), 0) << text;
  EXPECT_EQ(SampleValue(text, "rubato:generation_tokens_total" + model_label), 4 * 40) << text;
}

TEST(VllmMetricsTest, BothNamesCountTheSameRequests) {
  MetricsRegistry registry;
  Result<ServingMetrics> metrics = ServingMetrics::Register(registry, "m", 100, MetricNames::kBoth);
  ASSERT_TRUE(metrics.ok()) << metrics.status().message();
  metrics->CountEnd(RequestEnd::kTimedOut, "");
  metrics->prompt_tokens.Increment(7);
  metrics->kv_cache_usage.Set(0.25);
  const std::string text = registry.ExpositionText();
  EXPECT_EQ(SampleValue(text, "rubato:prompt_tokens_total{model_name=\"m\"}"), 7);
  EXPECT_EQ(SampleValue(text, "vllm:prompt_tokens_total{model_name=\"m\",engine=\"0\"}"), 7);
  EXPECT_EQ(SampleValue(text, "vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"}"), 0.25);
  EXPECT_EQ(SampleValue(text,
                        "rubato:request_success_total{model_name=\"m\",finished_reason="
                        "\"abort\"}"),
            1);
  EXPECT_EQ(SampleValue(text, "rubato:requests_timed_out_total{model_name=\"m\"}"), 1);
}

}  // namespace
}  // namespace rubato::server
