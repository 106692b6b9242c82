// Runs accuracy-suite instances through the engine under one config (model, backend, engine
// sizes, attention policy, KV residency) and scores them: the in-process core of
// `rubato_accuracy` and of the CI accuracy test. The CPU engine is the reference; the CUDA
// engine (engine.backend cuda, CUDA builds) runs the same instances in bf16.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "bench/accuracy/accuracy_instance.h"
#include "common/config.h"
#include "common/status.h"

namespace rubato {

struct AccuracyEvalOptions {
  int max_new_tokens = 26;  // greedy continuation length (the longest answer, 5 vartrack
                            // names, is <= 25 tokens + '.'; bench/accuracy/generate.py)
  int batch = 4;            // instances running together in the engine (engine.max_batch)
};

struct InstanceOutcome {
  const AccuracyInstance* instance = nullptr;  // into the evaluated list
  bool correct = false;
  std::string continuation;  // decoded generated text (stop token excluded)
  std::string prediction;    // what was compared with the answer (see ExtractPrediction)
  int prompt_tokens = 0;
  int asked_token_position = 0;  // index of the asked fact's first token in the prompt
  int asked_token_distance = 0;  // prompt_tokens - asked_token_position
  // Share of the sequence's KV positions the policy let a query attend (1 = dense), averaged
  // over the instance's generated tokens (an SFI slow step counts as 1: it attends densely).
  double retained_kv_ratio = 1.0;
};

struct AccuracyEvalResult {
  std::string policy;                     // the policy's name
  std::string backend;                    // "cpu" | "cuda"
  std::vector<InstanceOutcome> outcomes;  // in the order of the instances
  // The policy's stats line after the run (its step counts; the fidelity guard's firings).
  std::string policy_stats;
};

// Checks the config as `rubato generate` does (policy, backend of this build, residency),
// loads the model and tokenizer of `config` (model.path), checks that every instance fits the
// context (prompt + max_new_tokens <= engine max_context; an instance that does not is an
// OutOfRange error naming it), then runs all instances greedily, `batch` at a time.
Result<AccuracyEvalResult> RunAccuracyEval(const RubatoConfig& config,
                                           const std::vector<AccuracyInstance>& instances,
                                           const AccuracyEvalOptions& options);

// Accuracy over a group of outcomes.
struct AccuracyCell {
  int n = 0;
  int correct = 0;
  double retained_kv_ratio_sum = 0;
  double accuracy() const { return n > 0 ? static_cast<double>(correct) / n : 0.0; }
  double mean_retained_kv_ratio() const { return n > 0 ? retained_kv_ratio_sum / n : 0.0; }
  void Add(const InstanceOutcome& outcome);
};

// Outcomes grouped by (task, length bucket), ordered by task name then length.
std::map<std::pair<std::string, int>, AccuracyCell> AccuracyByTaskAndLength(
    const std::vector<InstanceOutcome>& outcomes);

}  // namespace rubato
