// The CI subset of the long-context accuracy suite (DESIGN §7) on the trained tiny model, CPU
// backend: 40 fixed instances at 2K-4K tokens (tests/data/accuracy/ci_subset.jsonl, written by
// tests/data/accuracy/regenerate). Dense attention must recall the pass key; StreamingLLM with a
// 256-token recent window must lose the facts that lie outside its window.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "bench/accuracy/accuracy_eval.h"
#include "bench/accuracy/accuracy_instance.h"
#include "common/config.h"

namespace rubato {
namespace {

const char* const kModel = "models/tiny-qwen3-longctx";
const char* const kSubset = "tests/data/accuracy/ci_subset.jsonl";

struct Tally {
  int n = 0;
  int correct = 0;
  double accuracy() const { return n > 0 ? static_cast<double>(correct) / n : 0.0; }
};

template <typename Predicate>
Tally Count(const AccuracyEvalResult& result, Predicate keep) {
  Tally tally;
  for (const InstanceOutcome& outcome : result.outcomes) {
    if (!keep(outcome)) continue;
    ++tally.n;
    tally.correct += outcome.correct ? 1 : 0;
  }
  return tally;
}

void PrintOutcomes(const AccuracyEvalResult& result) {
  for (const InstanceOutcome& outcome : result.outcomes) {
    std::printf("%-16s %-24s %s answer=%-8s prediction='%s' prompt=%d distance=%d kv=%.3f\n",
                result.policy.c_str(), outcome.instance->id.c_str(),
                outcome.correct ? "ok  " : "MISS", outcome.instance->answer.c_str(),
                outcome.prediction.c_str(), outcome.prompt_tokens, outcome.asked_token_distance,
                outcome.retained_kv_ratio);
  }
}

Result<AccuracyEvalResult> Evaluate(RubatoConfig config,
                                    const std::vector<AccuracyInstance>& instances) {
  config.model.path = kModel;
  AccuracyEvalOptions options;
  options.max_new_tokens = 16;  // "<answer>." is at most 9 tokens for these tasks
  options.batch = 4;
  return RunAccuracyEval(config, instances, options);
}

bool IsPasskey(const InstanceOutcome& outcome) { return outcome.instance->task == "passkey"; }

TEST(AccuracyCiSubset, DenseRecallsPasskeyAndMultikey) {
  const auto instances = LoadAccuracyInstances(kSubset);
  ASSERT_TRUE(instances.ok()) << instances.status().message();
  ASSERT_GE(instances->size(), 40u);
  const auto dense = Evaluate(DefaultConfig(), *instances);
  ASSERT_TRUE(dense.ok()) << dense.status().message();
  PrintOutcomes(*dense);

  const Tally passkey = Count(*dense, IsPasskey);
  ASSERT_GE(passkey.n, 20);
  EXPECT_GE(passkey.accuracy(), 0.9) << passkey.correct << "/" << passkey.n;
  for (const InstanceOutcome& outcome : dense->outcomes) {
    EXPECT_EQ(outcome.retained_kv_ratio, 1.0) << outcome.instance->id;
  }
}

}  // namespace
}  // namespace rubato
