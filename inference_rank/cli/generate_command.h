// `rubato generate`: load a model (CPU or CUDA backend), encode a prompt (text or token ids),
// stream generated text to stdout and end with one stats line; offloaded KV on a remote or an
// in-process cache rank. Every failure comes back as a Status for main() to print as one line.
// Narrative: docs/engine_and_models.md "The command line".
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

namespace rubato {

struct GenerateArgs {
  std::optional<std::string> model_dir;   // overrides config model.path
  std::optional<std::string> prompt;      // text; exactly one of prompt and prompt_ids
  std::optional<std::string> prompt_ids;  // "1,2,3": token ids instead of text
  bool chat = false;                      // wrap the prompt in the model's chat template
  bool random_weights = false;            // sets model.random_weights (config.json alone)
  std::optional<std::string> backend;     // "cpu" | "cuda", overrides config engine.backend
  int max_tokens = 128;
  bool output_ids = false;  // print the generated token ids, not their text
  float temperature = 0.f;  // 0: greedy
  float top_p = 1.f;
  int top_k = 0;  // 0: off
  uint64_t seed = 0;
  std::optional<std::string> policy;        // overrides config policy.name
  std::optional<std::string> kv_residency;  // overrides config engine.kv_residency
  std::optional<std::string> config_file;   // YAML config (docs/design.md §6)
  std::optional<int> threads;               // overrides config engine.threads
  // "host:port" of a cache rank (`rubato cache --listen`): an offload policy's KV goes there
  // instead of to the in-process (colocated) cache service. Overrides topology.cache_endpoints.
  std::optional<std::string> cache_endpoint;
};

// Runs the command. Text goes to stdout as it is generated; errors are returned.
Status RunGenerate(const GenerateArgs& args);

}  // namespace rubato
