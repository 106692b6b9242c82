// rubato_accuracy: scores one config (model + attention policy, CPU or CUDA engine) on the
// long-context accuracy suite and writes the results as JSON (docs/design.md §7, §8);
// bench/accuracy/run calls it once per policy and merges the outputs. Flags, output fields and
// examples: bench/accuracy/README.md. Every error is one line on stderr
// ("rubato_accuracy: error: ...") and exit status 1.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "bench/accuracy/accuracy_eval.h"
#include "bench/accuracy/accuracy_instance.h"
#include "common/config.h"
#include "common/text_file.h"

namespace rubato {
namespace {

struct RunnerArgs {
  std::string tasks_file;
  std::string model_dir;
  std::optional<std::string> config_file;
  std::string label;
  std::string out_file;
  std::optional<int> threads;
  std::optional<std::string> backend;  // overrides engine.backend
  std::optional<std::string> device_name;
  AccuracyEvalOptions eval;
};

// The CPU's model name from /proc/cpuinfo ("unknown" where there is none).
std::string CpuModelName() {
  const Result<std::string> cpuinfo = ReadTextFile("/proc/cpuinfo");
  if (!cpuinfo.ok()) return "unknown";
  const std::string key = "model name";
  const size_t at = cpuinfo->find(key);
  if (at == std::string::npos) return "unknown";
  const size_t colon = cpuinfo->find(':', at);
  const size_t end = cpuinfo->find('\n', at);
  if (colon == std::string::npos || colon > end) return "unknown";
  return cpuinfo->substr(colon + 2, end - colon - 2);
}

nlohmann::json OutcomeJson(const InstanceOutcome& outcome) {
  const AccuracyInstance& instance = *outcome.instance;
  return {{"id", instance.id},
          {"task", instance.task},
          {"length", instance.length},
          {"depth", instance.depth},
          {"correct", outcome.correct},
          {"answer", instance.answer},
          {"prediction", outcome.prediction},
          {"continuation", outcome.continuation},
          {"prompt_tokens", outcome.prompt_tokens},
          {"asked_token_position", outcome.asked_token_position},
          {"asked_token_distance", outcome.asked_token_distance},
          {"retained_kv_ratio", outcome.retained_kv_ratio}};
}

Status WriteResults(const RunnerArgs& args, const RubatoConfig& config,
                    const AccuracyEvalResult& result, double wall_seconds) {
  nlohmann::json summary = nlohmann::json::array();
  std::printf("%-20s %-10s %6s %8s %4s %9s\n", "label", "task", "length", "accuracy", "n",
              "kv_ratio");
  for (const auto& [key, cell] : AccuracyByTaskAndLength(result.outcomes)) {
    summary.push_back({{"task", key.first},
                       {"length", key.second},
                       {"accuracy", cell.accuracy()},
                       {"n", cell.n},
                       {"mean_retained_kv_ratio", cell.mean_retained_kv_ratio()}});
    std::printf("%-20s %-10s %6d %8.3f %4d %9.3f\n", args.label.c_str(), key.first.c_str(),
                key.second, cell.accuracy(), cell.n, cell.mean_retained_kv_ratio());
  }
  if (!result.policy_stats.empty()) std::printf("policy stats:%s\n", result.policy_stats.c_str());
  nlohmann::json instances = nlohmann::json::array();
  for (const InstanceOutcome& outcome : result.outcomes) instances.push_back(OutcomeJson(outcome));
  const nlohmann::json output = {
      {"label", args.label},
      {"policy", result.policy},
      {"backend", result.backend},
      {"config", args.config_file.value_or("(defaults)")},
      {"config_yaml", FormatConfigYaml(config)},
      {"model", config.model.path},
      {"tasks_file", args.tasks_file},
      {"max_new_tokens", args.eval.max_new_tokens},
      {"batch", args.eval.batch},
      {"threads", config.engine.threads},
      {"device",
       args.device_name.value_or(result.backend == "cpu" ? CpuModelName() : result.backend)},
      {"wall_seconds", wall_seconds},
      {"policy_stats", result.policy_stats},
      {"summary", summary},
      {"instances", instances}};
  std::ofstream out(args.out_file);
  out << output.dump(2) << "\n";
  out.close();
  if (!out) return IoError("cannot write '" + args.out_file + "'");
  return Status::Ok();
}

Status Run(const RunnerArgs& args) {
  RubatoConfig config = DefaultConfig();
  if (args.config_file) {
    RUBATO_ASSIGN_OR_RETURN(config, LoadConfigFile(*args.config_file));
  }
  config.model.path = args.model_dir;
  if (args.threads) config.engine.threads = *args.threads;
  if (args.backend) {
    config.engine.backend =
        *args.backend == "cuda" ? EngineSection::Backend::kCuda : EngineSection::Backend::kCpu;
  }
  RUBATO_ASSIGN_OR_RETURN(std::vector<AccuracyInstance> instances,
                          LoadAccuracyInstances(args.tasks_file));
  const auto start = std::chrono::steady_clock::now();
  RUBATO_ASSIGN_OR_RETURN(AccuracyEvalResult result, RunAccuracyEval(config, instances, args.eval));
  const double wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return WriteResults(args, config, result, wall_seconds);
}

int PrintError(const std::string& message, int exit_code) {
  std::fprintf(stderr, "rubato_accuracy: error: %s\n", message.c_str());
  return exit_code;
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::RunnerArgs args;
  CLI::App app{"rubato_accuracy: long-context accuracy suite for one config"};
  app.add_option("--tasks-file", args.tasks_file, "Instances (.jsonl from generate.py)")
      ->required();
  app.add_option("--model", args.model_dir, "Model directory (overrides model.path)")->required();
  app.add_option("--config", args.config_file, "YAML config: policy, engine sizes");
  app.add_option("--label", args.label, "Name of this run in the results")->required();
  app.add_option("--out", args.out_file, "Results JSON file")->required();
  app.add_option("--backend", args.backend, "cpu or cuda (overrides engine.backend)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--device-name", args.device_name,
                 "Device recorded in the results (default: the CPU's model name, or 'cuda')");
  app.add_option("--threads", args.threads, "CPU threads (overrides engine.threads)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--max-new-tokens", args.eval.max_new_tokens, "Greedy tokens per instance")
      ->check(CLI::Range(1, 4096));
  app.add_option("--batch", args.eval.batch, "Instances running together")
      ->check(CLI::Range(1, 256));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return rubato::PrintError(e.what(), 2);
  }
  try {
    const rubato::Status status = rubato::Run(args);
    if (!status.ok()) return rubato::PrintError(status.message(), 1);
  } catch (const std::exception& e) {
    return rubato::PrintError(std::string("internal error: ") + e.what(), 1);
  }
  return 0;
}
