// What `rubato generate` and `rubato serve` share before their first token: the config with the
// command-line overrides, the checks of what this build and the policy can run, the model
// (CPU or CUDA backend), the engine options from the config, and the residency requests' KV
// lives in (a cache rank for offloaded KV). Every failure is a Status naming the flag or config
// key.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "common/config.h"
#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/model/model.h"
#include "inference_rank/policies/policy_registry.h"
#include "inference_rank/residency/residency.h"

namespace rubato {

// Command-line flags that override config keys (unset: the config file's value, or the default).
struct ConfigOverrides {
  std::optional<std::string> config_file;  // YAML config (docs/design.md §6)
  std::optional<std::string> model_dir;    // model.path
  bool random_weights = false;             // model.random_weights
  std::optional<std::string> backend;      // "cpu" | "cuda": engine.backend
  std::optional<std::string> policy;       // policy.name
  std::optional<std::string>
      kv_residency;            // engine.kv_residency: auto | local | offloaded | evicting
  std::optional<int> threads;  // engine.threads
  // "host:port" of a cache rank (`rubato cache --listen`): topology.mode disaggregated over ucx
  // with this one cache endpoint.
  std::optional<std::string> cache_endpoint;
};

// The config file (or the defaults) with the overrides applied.
Result<RubatoConfig> ResolveConfig(const ConfigOverrides& overrides);

// Backends and topologies this build cannot run, rejected before anything is loaded.
Status CheckSupportedByThisBuild(const RubatoConfig& config);

// Offloaded KV needs, disaggregated, a cache endpoint reached over ucx or nccl; a cache endpoint
// needs offloaded KV.
Status CheckOffloadChoice(const RubatoConfig& config, const PolicyChoice& policy);

// What every command checks before it loads anything: the policy of `config` (resolved), what
// this build and that policy can run, and that the model directory exists.
Result<PolicyChoice> ResolveAndCheck(const RubatoConfig& config);

// The policy's host half gets the tokenizer (may be null) and goes into `options`.
Status ApplyPolicy(const PolicyChoice& policy, const Tokenizer* tokenizer, EngineOptions& options);

// The residency of the policy's choice (engine.kv_residency, or offloaded for the old offload_*
// policy names) from the residency table, for `model`'s shapes: for offloaded KV, connected to
// the cache rank of `config` (remote, reconnected when lost, or one in this process). Goes into
// EngineOptions::residency.
Result<std::shared_ptr<Residency>> MakeResidency(const RubatoConfig& config,
                                                 const PolicyChoice& policy,
                                                 const ModelConfig& model);

// The model of `model_dir` on config.engine.backend (random weights when model.random_weights).
Result<std::unique_ptr<Model>> LoadModel(const RubatoConfig& config,
                                         const std::filesystem::path& model_dir);

// engine.max_batch / max_context / block_size / prefill_chunk / threads as EngineOptions (the
// policy, metrics and residency fields are left for the caller).
EngineOptions EngineOptionsFromConfig(const RubatoConfig& config);

}  // namespace rubato
