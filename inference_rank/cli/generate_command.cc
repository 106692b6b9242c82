// `rubato generate` (see generate_command.h): config -> policy check -> prompt (tokenizer or ids)
// -> model (CPU or CUDA backend) -> engine, then streams tokens to stdout as the engine produces
// them and prints one stats line.
#include "inference_rank/cli/generate_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "common/config.h"
#include "common/logging.h"
#include "common/tokenizer/stream_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/cli/engine_setup.h"
#include "inference_rank/cli/generate_stream.h"
#include "inference_rank/cli/mpi_launch.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/model/model.h"
#include "inference_rank/policies/policy_registry.h"

namespace rubato {
namespace {

using Clock = std::chrono::steady_clock;

double MillisecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The flags that override config keys (engine_setup.h).
ConfigOverrides OverridesOf(const GenerateArgs& args) {
  ConfigOverrides overrides;
  overrides.config_file = args.config_file;
  overrides.model_dir = args.model_dir;
  overrides.random_weights = args.random_weights;
  overrides.backend = args.backend;
  overrides.policy = args.policy;
  overrides.kv_residency = args.kv_residency;
  overrides.threads = args.threads;
  overrides.cache_endpoint = args.cache_endpoint;
  return overrides;
}

// "1,2,3" -> {1, 2, 3}. Range against the vocabulary is checked by the engine.
Result<std::vector<int>> ParsePromptIds(std::string_view text) {
  std::vector<int> ids;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(begin, end - begin);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    int id = 0;
    const auto [next, error] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (item.empty() || error != std::errc() || next != item.data() + item.size() || id < 0) {
      return InvalidArgumentError("--prompt-ids: '" + std::string(item) + "' (item " +
                                  std::to_string(ids.size()) +
                                  ") is not a token id; expected non-negative integers like "
                                  "1,2,3");
    }
    ids.push_back(id);
    begin = end + 1;
  }
  return ids;
}

Result<std::vector<int>> EncodePrompt(const Tokenizer& tokenizer, const GenerateArgs& args) {
  if (!args.chat) {
    // Like `tokenizer(prompt)` in transformers: the post-processor adds BOS where the model
    // has one (Llama-3), nothing for Qwen.
    return tokenizer.Encode(*args.prompt, /*add_special_tokens=*/true);
  }
  const std::vector<ChatMessage> messages = {{"user", *args.prompt}};
  RUBATO_ASSIGN_OR_RETURN(std::string text, tokenizer.ApplyChatTemplate(messages));
  // The template already holds every special token (Llama-3's BOS included).
  return tokenizer.Encode(text, /*add_special_tokens=*/false);
}

Status GenerateWithConfig(const GenerateArgs& args, RubatoConfig& config);

}  // namespace

Status RunGenerate(const GenerateArgs& args) {
  RUBATO_ASSIGN_OR_RETURN(RubatoConfig config, ResolveConfig(OverridesOf(args)));
  RUBATO_RETURN_IF_ERROR(SetGlobalLogLevel(config.logging.level));
  // Under mpirun with topology.ranks: a cache rank serves; this rank finds it (mpi_launch.h).
  return RunWithMpiRoles(
      config, [&](RubatoConfig& resolved) { return GenerateWithConfig(args, resolved); });
}

namespace {

Status GenerateWithConfig(const GenerateArgs& args, RubatoConfig& config) {
  RUBATO_ASSIGN_OR_RETURN(PolicyChoice policy, ResolveAndCheck(config));
  const std::filesystem::path model_dir = config.model.path;
  if (args.prompt.has_value() == args.prompt_ids.has_value()) {
    return InvalidArgumentError("give the prompt as --prompt TEXT or as --prompt-ids 1,2,3");
  }
  if (args.chat && args.prompt_ids) {
    return InvalidArgumentError("--chat needs the prompt as text (--prompt)");
  }
  // Text needs the tokenizer; ids use it only to print text, when the directory has one.
  std::unique_ptr<Tokenizer> tokenizer;
  if (args.prompt || std::filesystem::exists(model_dir / "tokenizer.json")) {
    RUBATO_ASSIGN_OR_RETURN(tokenizer, Tokenizer::LoadFromDirectory(model_dir));
  }
  std::vector<int> prompt_ids;
  if (args.prompt_ids) {
    RUBATO_ASSIGN_OR_RETURN(prompt_ids, ParsePromptIds(*args.prompt_ids));
  } else {
    RUBATO_ASSIGN_OR_RETURN(prompt_ids, EncodePrompt(*tokenizer, args));
  }
  const int max_prompt = config.limits.max_prompt_tokens;
  if (max_prompt > 0 && static_cast<int>(prompt_ids.size()) > max_prompt) {
    return OutOfRangeError("prompt has " + std::to_string(prompt_ids.size()) +
                           " tokens but limits.max_prompt_tokens is " + std::to_string(max_prompt));
  }

  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, LoadModel(config, model_dir));
  RUBATO_LOG_INFO("cli", "model {}: {} parameters, {} bytes of {} weights, policy {}",
                  model_dir.string(), model->parameter_count(), model->weight_bytes(),
                  model->backend_name(), policy.name);
  const std::string backend(model->backend_name());

  EngineOptions engine_options = EngineOptionsFromConfig(config);
  RUBATO_RETURN_IF_ERROR(ApplyPolicy(policy, tokenizer.get(), engine_options));
  RUBATO_ASSIGN_OR_RETURN(engine_options.residency, MakeResidency(config, policy, model->config()));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          Engine::Create(std::move(model), engine_options));

  GenerationRequest request;
  request.prompt_ids = prompt_ids;
  request.sampling = {args.temperature, args.top_k, args.top_p, args.seed};
  request.max_new_tokens = args.max_tokens;
  RUBATO_RETURN_IF_ERROR(engine->Submit(std::move(request)).status());

  // Text through the tokenizer, or ids ("12 7 93 ") when the model directory has none or
  // --output-ids asks for them.
  std::unique_ptr<StreamDecoder> decoder;
  if (tokenizer && !args.output_ids) {
    decoder = std::make_unique<StreamDecoder>(*tokenizer, /*skip_special_tokens=*/true);
  }
  const Clock::time_point start = Clock::now();
  GenerateStreamStats stats;
  RUBATO_RETURN_IF_ERROR(StreamGeneratedTokens(*engine, decoder.get(), stdout, start, stats));
  const Clock::time_point first_token_time = stats.first_token;
  const Clock::time_point last_token_time = stats.last_token;
  const int generated = stats.generated;
  const double retained_kv_sum = stats.retained_kv_sum;

  const double prefill_ms = MillisecondsBetween(start, first_token_time);
  const double decode_s = MillisecondsBetween(first_token_time, last_token_time) / 1000.0;
  const double decode_tok_s = generated > 1 && decode_s > 0 ? (generated - 1) / decode_s : 0.0;
  const double retained_kv = generated > 0 ? retained_kv_sum / generated : 1.0;
  // The local KV pool: the most blocks held at once, of how many; with a local window (offloaded
  // KV on the CPU model, docs/residency.md) the positions kept before the one written.
  std::string kv_blocks =
      " kv_blocks_peak=" + std::to_string(engine->peak_used_blocks()) +
      " kv_pool_blocks=" + std::to_string(engine->kv_cache().shape().num_blocks);
  if (engine->local_window() >= 0) {
    kv_blocks += " local_kv_window=" + std::to_string(engine->local_window());
  }
  std::printf(
      "\n[rubato] prompt_tokens=%zu generated_tokens=%d prefill_ms=%.1f "
      "decode_tok_s=%.1f policy=%s retained_kv=%.3f backend=%s%s%s%s\n",
      prompt_ids.size(), generated, prefill_ms, decode_tok_s, config.policy.name.c_str(),
      retained_kv, backend.c_str(), policy.policy->StatsLine().c_str(),
      engine_options.residency->StatsLine().c_str(), kv_blocks.c_str());
  std::fflush(stdout);
  return Status::Ok();
}

}  // namespace
}  // namespace rubato
