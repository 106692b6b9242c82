// RunAccuracyEval (see accuracy_eval.h): config -> policy -> tokenizer -> model (CPU or CUDA, as
// `rubato generate` loads it) -> engine, then every instance submitted at once; the engine's
// FCFS scheduler keeps `batch` of them running.
#include "bench/accuracy/accuracy_eval.h"

#include <filesystem>
#include <memory>
#include <unordered_map>

#include "common/tokenizer/tokenizer.h"
#include "inference_rank/cli/engine_setup.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/policies/policy_registry.h"

namespace rubato {
namespace {

// Where the asked fact starts, in tokens: the token count of the prompt before it. The prefix
// is cut before the space that joins the fact to the text before it, because that space belongs
// to the fact's first token (" The") when the whole prompt is encoded.
Result<int> AskedTokenPosition(const Tokenizer& tokenizer, const AccuracyInstance& instance) {
  RUBATO_ASSIGN_OR_RETURN(size_t byte_offset,
                          Utf8ByteOffset(instance.prompt, instance.asked_char_offset));
  std::string_view prefix(instance.prompt.data(), byte_offset);
  while (!prefix.empty() && prefix.back() == ' ') prefix.remove_suffix(1);
  return static_cast<int>(tokenizer.Encode(prefix, /*add_special_tokens=*/true).size());
}

}  // namespace

void AccuracyCell::Add(const InstanceOutcome& outcome) {
  ++n;
  correct += outcome.correct ? 1 : 0;
  retained_kv_ratio_sum += outcome.retained_kv_ratio;
}

std::map<std::pair<std::string, int>, AccuracyCell> AccuracyByTaskAndLength(
    const std::vector<InstanceOutcome>& outcomes) {
  std::map<std::pair<std::string, int>, AccuracyCell> cells;
  for (const InstanceOutcome& outcome : outcomes) {
    cells[{outcome.instance->task, outcome.instance->length}].Add(outcome);
  }
  return cells;
}

Result<AccuracyEvalResult> RunAccuracyEval(const RubatoConfig& config,
                                           const std::vector<AccuracyInstance>& instances,
                                           const AccuracyEvalOptions& options) {
  if (options.max_new_tokens < 1 || options.batch < 1) {
    return InvalidArgumentError("accuracy: max_new_tokens and batch must be >= 1");
  }
  RUBATO_ASSIGN_OR_RETURN(PolicyChoice policy, ResolveAndCheck(config));
  const std::filesystem::path model_dir = config.model.path;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::LoadFromDirectory(model_dir));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(config, model_dir));
  const int max_context = config.engine.max_context > 0 ? config.engine.max_context
                                                        : model->config().max_position_embeddings;

  AccuracyEvalResult result;
  result.policy = policy.name;
  result.outcomes.resize(instances.size());
  std::vector<std::vector<int>> prompts(instances.size());
  for (size_t i = 0; i < instances.size(); ++i) {
    const AccuracyInstance& instance = instances[i];
    prompts[i] = tokenizer->Encode(instance.prompt, /*add_special_tokens=*/true);
    InstanceOutcome& outcome = result.outcomes[i];
    outcome.instance = &instance;
    outcome.prompt_tokens = static_cast<int>(prompts[i].size());
    if (outcome.prompt_tokens + options.max_new_tokens > max_context) {
      return OutOfRangeError(
          "accuracy: instance '" + instance.id + "' has " + std::to_string(outcome.prompt_tokens) +
          " prompt tokens; with " + std::to_string(options.max_new_tokens) +
          " new tokens it exceeds the context of " + std::to_string(max_context) + " tokens");
    }
    RUBATO_ASSIGN_OR_RETURN(outcome.asked_token_position, AskedTokenPosition(*tokenizer, instance));
    outcome.asked_token_distance = outcome.prompt_tokens - outcome.asked_token_position;
  }

  EngineOptions engine_options = EngineOptionsFromConfig(config);
  engine_options.max_batch = options.batch;
  RUBATO_RETURN_IF_ERROR(ApplyPolicy(policy, tokenizer.get(), engine_options));
  RUBATO_ASSIGN_OR_RETURN(engine_options.residency, MakeResidency(config, policy, model->config()));
  result.backend = std::string(model->backend_name());
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          Engine::Create(std::move(model), engine_options));
  std::unordered_map<uint64_t, size_t> instance_of_request;
  for (size_t i = 0; i < instances.size(); ++i) {
    GenerationRequest request;
    request.prompt_ids = std::move(prompts[i]);
    request.max_new_tokens = options.max_new_tokens;  // greedy: default SamplingParams
    RUBATO_ASSIGN_OR_RETURN(uint64_t id, engine->Submit(std::move(request)));
    instance_of_request[id] = i;
  }
  std::vector<std::vector<int>> generated(instances.size());
  std::vector<double> retained_sum(instances.size(), 0.0);  // over each instance's tokens
  std::vector<int> tokens(instances.size(), 0);
  while (engine->HasWork()) {
    RUBATO_ASSIGN_OR_RETURN(std::vector<TokenEvent> events, engine->Step());
    for (const TokenEvent& event : events) {
      const size_t i = instance_of_request.at(event.request_id);
      if (event.finish != FinishReason::kStop) generated[i].push_back(event.token);
      retained_sum[i] += event.retained_kv_ratio;
      ++tokens[i];
      if (event.finish == FinishReason::kNone) continue;
      InstanceOutcome& outcome = result.outcomes[i];
      outcome.continuation = tokenizer->Decode(generated[i], /*skip_special_tokens=*/true);
      outcome.prediction = ExtractPrediction(outcome.continuation);
      outcome.correct = ScoreContinuation(outcome.continuation, instances[i].answer);
      outcome.retained_kv_ratio = retained_sum[i] / tokens[i];
    }
  }
  if (engine->options().policy != nullptr) {
    result.policy_stats = engine->options().policy->StatsLine();
  }
  return result;
}

}  // namespace rubato
