// rubato_fidelity: where a selection policy loses attention mass (docs/fidelity.md). Runs
// accuracy-suite instances one at a time on the CPU engine under one config, with the policy
// wrapped in the probe (fidelity_probe.h): at each generated token, per layer and KV head, the
// share of the query's dense attention mass on the rows the policy attended, and for vartrack
// the dense mass on each fact of the asked chain (hop 0: "VAR A = 41297.", hop i: "VAR B = VAR
// A.") and how much of it the policy kept. A policy whose KV evicts (LongFlow) is measured by
// a teacher-forced dense twin: a dense engine fed the run's tokens, its queries' attention
// compared with the positions the run's slots held. Writes JSON and prints markdown tables. A
// benchmark tool, not a test. Flags and output: bench/accuracy/README.md "Fidelity".
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/accuracy/accuracy_instance.h"
#include "bench/accuracy/fidelity_probe.h"
#include "common/config.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/cli/engine_setup.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/policies/policy_registry.h"

namespace rubato {
namespace {

struct Args {
  std::string tasks_file;
  std::string model_dir;
  std::optional<std::string> config_file;
  std::string label;
  std::string out_file;
  std::optional<std::string> markdown_file;
  std::optional<int> threads;
  std::optional<std::string> task;  // only this task's instances
  int limit = 0;                    // at most this many instances (0: all)
  int max_new_tokens = 26;
};

// Token span [begin, end) of the first occurrence of `fact` in the prompt; (-1, -1) if absent.
std::pair<int, int> FactSpan(const Tokenizer& tokenizer, const std::string& prompt,
                             const std::string& fact) {
  const size_t at = prompt.find(fact);
  if (at == std::string::npos) return {-1, -1};
  std::string_view before(prompt.data(), at);
  while (!before.empty() && before.back() == ' ') before.remove_suffix(1);
  const int begin = static_cast<int>(tokenizer.Encode(before, true).size());
  const std::string_view through(prompt.data(), at + fact.size());
  return {begin, static_cast<int>(tokenizer.Encode(through, true).size())};
}

// The asked chain's facts of a vartrack instance (its answer is the chain's names in order).
std::vector<std::pair<int, int>> ChainSpans(const Tokenizer& tokenizer,
                                            const AccuracyInstance& instance) {
  std::vector<std::pair<int, int>> spans;
  if (instance.task != "vartrack") return spans;
  std::istringstream names_in(instance.answer);
  std::vector<std::string> names;
  for (std::string name; names_in >> name;) names.push_back(name);
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string fact =
        i == 0 ? "VAR " + names[0] + " = " : "VAR " + names[i] + " = VAR " + names[i - 1] + ".";
    std::pair<int, int> span = FactSpan(tokenizer, instance.prompt, fact);
    if (i == 0 && span.first >= 0) span.second += 3;  // the value and '.' after "= "
    spans.push_back(span);
  }
  return spans;
}

// Sums for the markdown tables, over the sparse (not dense) measured steps.
struct Totals {
  int layers = 0, kv_heads = 0;
  std::vector<double> share_sum, share_min_sum;  // [layer]: mean over heads; min over heads
  int steps = 0, dense_steps = 0, unmeasured_steps = 0;
  // [first hop, later hops][layer]: dense mass on the hop facts, and the part kept.
  std::vector<double> hop_dense[2], hop_kept[2];
  double share_correct = 0, share_wrong = 0;
  int steps_correct = 0, steps_wrong = 0;

  void Init(int l, int h) {
    layers = l;
    kv_heads = h;
    share_sum.assign(l, 0.0);
    share_min_sum.assign(l, 0.0);
    for (auto* v : {&hop_dense[0], &hop_dense[1], &hop_kept[0], &hop_kept[1]}) v->assign(l, 0.0);
  }
  void Add(const ProbeStep& step, size_t spans, bool correct) {
    if (!step.measured) return void(++unmeasured_steps);
    if (step.dense) return void(++dense_steps);
    ++steps;
    double all = 0;
    for (int l = 0; l < layers; ++l) {
      double sum = 0, min = 1;
      for (int h = 0; h < kv_heads; ++h) {
        const double s = step.share[static_cast<size_t>(l) * kv_heads + h];
        sum += s;
        min = std::min(min, s);
      }
      share_sum[l] += sum / kv_heads;
      share_min_sum[l] += min;
      all += sum / kv_heads / layers;
      for (size_t s = 0; s < spans; ++s) {
        for (int h = 0; h < kv_heads; ++h) {
          const size_t at = (s * layers + l) * kv_heads + h;
          hop_dense[s == 0 ? 0 : 1][l] += step.span_dense[at];
          hop_kept[s == 0 ? 0 : 1][l] += step.span_kept[at];
        }
      }
    }
    (correct ? share_correct : share_wrong) += all;
    ++(correct ? steps_correct : steps_wrong);
  }
};

std::string Markdown(const Args& args, const Totals& t, int instances, int correct, bool hops) {
  std::string md;
  char line[256];
  std::snprintf(line, sizeof(line),
                "%s: %d instances, %d correct; %d sparse steps measured, %d dense, %d not "
                "measurable\n\n",
                args.label.c_str(), instances, correct, t.steps, t.dense_steps, t.unmeasured_steps);
  md += line;
  if (t.steps == 0) return md;
  md += hops ? "| layer | mass kept (mean of heads) | worst head | first hop: dense mass, kept | "
               "later hops: dense mass, kept |\n|---|---|---|---|---|\n"
             : "| layer | mass kept (mean of heads) | worst head |\n|---|---|---|\n";
  for (int l = 0; l < t.layers; ++l) {
    auto ratio = [](double kept, double dense) { return dense > 0 ? kept / dense : 1.0; };
    std::snprintf(line, sizeof(line), "| %d | %.3f | %.3f |", l, t.share_sum[l] / t.steps,
                  t.share_min_sum[l] / t.steps);
    md += line;
    if (hops) {
      std::snprintf(
          line, sizeof(line), " %.3f, %.2f | %.3f, %.2f |",
          t.hop_dense[0][l] / t.steps / t.kv_heads, ratio(t.hop_kept[0][l], t.hop_dense[0][l]),
          t.hop_dense[1][l] / t.steps / t.kv_heads, ratio(t.hop_kept[1][l], t.hop_dense[1][l]));
      md += line;
    }
    md += "\n";
  }
  std::snprintf(line, sizeof(line),
                "\nMean mass kept per step: %.3f on correct instances (%d steps), %.3f on "
                "wrong ones (%d steps).\n",
                t.steps_correct ? t.share_correct / t.steps_correct : 0.0, t.steps_correct,
                t.steps_wrong ? t.share_wrong / t.steps_wrong : 0.0, t.steps_wrong);
  md += line;
  return md;
}

// An engine on the CPU model under `config`'s policy, wrapped in the probe.
Result<std::unique_ptr<Engine>> MakeProbedEngine(const RubatoConfig& config,
                                                 const Tokenizer& tokenizer,
                                                 ProbeRecorder* recorder) {
  RUBATO_ASSIGN_OR_RETURN(PolicyChoice policy, ResolveAndCheck(config));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(config, config.model.path));
  const ModelConfig model_config = model->config();
  EngineOptions options = EngineOptionsFromConfig(config);
  options.max_batch = 1;  // one request at a time: the recorder follows it
  RUBATO_RETURN_IF_ERROR(ApplyPolicy(policy, &tokenizer, options));
  RUBATO_ASSIGN_OR_RETURN(options.residency, MakeResidency(config, policy, model_config));
  options.policy = MakeProbedPolicy(options.policy, recorder);
  return Engine::Create(std::move(model), options);
}

// Runs `prompt` greedily for up to `max_new_tokens`; the tokens generated (the stop token not).
Result<std::vector<int>> Generate(Engine& engine, std::vector<int> prompt, int max_new_tokens) {
  GenerationRequest request;
  request.prompt_ids = std::move(prompt);
  request.max_new_tokens = max_new_tokens;
  RUBATO_RETURN_IF_ERROR(engine.Submit(std::move(request)).status());
  std::vector<int> generated;
  while (engine.HasWork()) {
    RUBATO_ASSIGN_OR_RETURN(std::vector<TokenEvent> events, engine.Step());
    for (const TokenEvent& event : events) {
      if (event.finish == FinishReason::kError) return event.error;
      if (event.finish != FinishReason::kStop) generated.push_back(event.token);
    }
  }
  return generated;
}

// The teacher-forced dense twin of a run whose steps the probe could not measure (evicted KV):
// a dense engine (local KV) prefills the run's prompt and generated tokens, and the probe
// measures each of those positions' queries against the positions the run's slots held there.
// The twin's queries are dense attention's on the same tokens, the question the yardstick asks:
// how much of the mass a dense model puts there did the policy keep. Replaces the run's steps.
class DenseTwin {
 public:
  static Result<std::unique_ptr<DenseTwin>> Create(RubatoConfig config,
                                                   const Tokenizer& tokenizer) {
    config.policy = PolicySection();  // dense
    config.engine.kv_residency = "auto";
    auto twin = std::unique_ptr<DenseTwin>(new DenseTwin());
    RUBATO_ASSIGN_OR_RETURN(twin->engine_, MakeProbedEngine(config, tokenizer, &twin->recorder_));
    return twin;
  }
  Status Measure(std::vector<int> prompt, const std::vector<int>& generated, ProbeRecorder& run) {
    recorder_.Reset(run.spans);
    recorder_.teacher = &run.steps;
    prompt.insert(prompt.end(), generated.begin(), generated.end());
    RUBATO_RETURN_IF_ERROR(Generate(*engine_, std::move(prompt), 1).status());
    for (auto& [position, step] : run.steps) {
      if (step.kept.empty()) continue;
      const auto found = recorder_.steps.find(position);
      if (found == recorder_.steps.end()) {
        return InternalError("rubato_fidelity: the dense twin did not reach position " +
                             std::to_string(position));
      }
      step = std::move(found->second);
    }
    return Status::Ok();
  }

 private:
  DenseTwin() = default;
  ProbeRecorder recorder_;
  std::unique_ptr<Engine> engine_;
};

nlohmann::json StepJson(const ProbeStep& step, int layers, int kv_heads, size_t spans) {
  auto cut = [&](const std::vector<double>& v, size_t offset) {
    nlohmann::json rows = nlohmann::json::array();
    for (int l = 0; l < layers; ++l) {
      nlohmann::json row = nlohmann::json::array();
      for (int h = 0; h < kv_heads; ++h) {
        // Four decimals: the file stays small and the tables read two.
        row.push_back(std::round(v[offset + static_cast<size_t>(l) * kv_heads + h] * 1e4) / 1e4);
      }
      rows.push_back(row);
    }
    return rows;
  };
  nlohmann::json out = {
      {"position", step.position}, {"dense", step.dense}, {"measured", step.measured}};
  if (step.twin) out["twin"] = true;
  if (!step.measured) return out;
  out["share"] = cut(step.share, 0);
  nlohmann::json dense = nlohmann::json::array(), kept = nlohmann::json::array();
  for (size_t s = 0; s < spans; ++s) {
    dense.push_back(cut(step.span_dense, s * layers * kv_heads));
    kept.push_back(cut(step.span_kept, s * layers * kv_heads));
  }
  out["hop_dense"] = dense;
  out["hop_kept"] = kept;
  if (step.twin) {  // an evicting policy: how much of each fact the slots still held
    nlohmann::json held = nlohmann::json::array();
    for (size_t s = 0; s < spans; ++s) held.push_back(cut(step.span_held, s * layers * kv_heads));
    out["hop_held"] = held;
  }
  return out;
}

Status Run(const Args& args) {
  RubatoConfig config = DefaultConfig();
  if (args.config_file) {
    RUBATO_ASSIGN_OR_RETURN(config, LoadConfigFile(*args.config_file));
  }
  config.model.path = args.model_dir;
  config.engine.backend = EngineSection::Backend::kCpu;
  if (args.threads) config.engine.threads = *args.threads;
  RUBATO_ASSIGN_OR_RETURN(std::vector<AccuracyInstance> all,
                          LoadAccuracyInstances(args.tasks_file));
  std::vector<AccuracyInstance> instances;
  for (AccuracyInstance& instance : all) {
    if (args.task && instance.task != *args.task) continue;
    if (args.limit > 0 && static_cast<int>(instances.size()) >= args.limit) break;
    instances.push_back(std::move(instance));
  }
  if (instances.empty()) return InvalidArgumentError("rubato_fidelity: no instance to run");

  RUBATO_ASSIGN_OR_RETURN(PolicyChoice policy, ResolveAndCheck(config));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::LoadFromDirectory(config.model.path));
  ProbeRecorder recorder;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          MakeProbedEngine(config, *tokenizer, &recorder));
  const int layers = engine->model().config().num_layers;
  const int kv_heads = engine->model().config().num_kv_heads;
  std::unique_ptr<DenseTwin> twin;  // made at the first run that needs it

  Totals totals;
  totals.Init(layers, kv_heads);
  nlohmann::json out_instances = nlohmann::json::array();
  int correct_count = 0;
  bool any_hops = false;
  for (const AccuracyInstance& instance : instances) {
    std::vector<std::pair<int, int>> spans = ChainSpans(*tokenizer, instance);
    any_hops = any_hops || !spans.empty();
    recorder.Reset(spans);
    const std::vector<int> prompt = tokenizer->Encode(instance.prompt, true);
    const int prompt_tokens = static_cast<int>(prompt.size());
    RUBATO_ASSIGN_OR_RETURN(std::vector<int> generated,
                            Generate(*engine, prompt, args.max_new_tokens));
    const bool evicted = std::any_of(recorder.steps.begin(), recorder.steps.end(),
                                     [](const auto& step) { return !step.second.kept.empty(); });
    if (evicted) {
      if (twin == nullptr) {
        RUBATO_ASSIGN_OR_RETURN(twin, DenseTwin::Create(config, *tokenizer));
      }
      RUBATO_RETURN_IF_ERROR(twin->Measure(prompt, generated, recorder));
    }
    const std::string continuation = tokenizer->Decode(generated, true);
    const bool correct = ScoreContinuation(continuation, instance.answer);
    correct_count += correct ? 1 : 0;
    nlohmann::json steps = nlohmann::json::array();
    for (const auto& [position, step] : recorder.steps) {
      totals.Add(step, spans.size(), correct);
      steps.push_back(StepJson(step, layers, kv_heads, spans.size()));
    }
    nlohmann::json hops = nlohmann::json::array();
    for (const auto& [begin, end] : spans) hops.push_back({begin, end});
    out_instances.push_back({{"id", instance.id},
                             {"correct", correct},
                             {"answer", instance.answer},
                             {"prediction", ExtractPrediction(continuation)},
                             {"prompt_tokens", prompt_tokens},
                             {"hops", hops},
                             {"steps", steps}});
    std::fprintf(stderr, "%s %s: %s (%s)\n", args.label.c_str(), instance.id.c_str(),
                 correct ? "right" : "wrong", ExtractPrediction(continuation).c_str());
  }
  const std::string md =
      Markdown(args, totals, static_cast<int>(instances.size()), correct_count, any_hops);
  std::printf("%s", md.c_str());
  const nlohmann::json output = {{"label", args.label},
                                 {"policy", policy.name},
                                 {"config", args.config_file.value_or("(defaults)")},
                                 {"model", config.model.path},
                                 {"tasks_file", args.tasks_file},
                                 {"stats", engine->options().policy->StatsLine()},
                                 {"layers", layers},
                                 {"kv_heads", kv_heads},
                                 {"correct", correct_count},
                                 {"n", instances.size()},
                                 {"instances", out_instances}};
  std::ofstream out(args.out_file);
  out << output.dump() << "\n";
  out.close();
  if (!out) return IoError("cannot write '" + args.out_file + "'");
  if (args.markdown_file) {
    std::ofstream markdown(*args.markdown_file);
    markdown << md;
    if (!markdown) return IoError("cannot write '" + *args.markdown_file + "'");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Args args;
  CLI::App app{"rubato_fidelity: the dense attention mass a policy's rows keep (CPU engine)"};
  app.add_option("--tasks-file", args.tasks_file, "Instances (.jsonl from generate.py)")
      ->required();
  app.add_option("--model", args.model_dir, "Model directory (overrides model.path)")->required();
  app.add_option("--config", args.config_file, "YAML config: the policy");
  app.add_option("--label", args.label, "Name of this run")->required();
  app.add_option("--out", args.out_file, "Results JSON file")->required();
  app.add_option("--markdown", args.markdown_file, "Also write the tables to this file");
  app.add_option("--threads", args.threads, "CPU threads (overrides engine.threads)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--task", args.task, "Only this task's instances");
  app.add_option("--limit", args.limit, "At most this many instances")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--max-new-tokens", args.max_new_tokens, "Greedy tokens per instance")
      ->check(CLI::Range(1, 4096));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "rubato_fidelity: error: %s\n", e.what());
    return 2;
  }
  try {
    const rubato::Status status = rubato::Run(args);
    if (!status.ok()) {
      std::fprintf(stderr, "rubato_fidelity: error: %s\n", status.message().c_str());
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rubato_fidelity: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
