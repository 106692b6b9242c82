// Config overrides, build / policy checks, model loading and the residency shared by
// `rubato generate` and `rubato serve` (see engine_setup.h).
#include "inference_rank/cli/engine_setup.h"

#include <utility>

#include "common/json_limits.h"
#include "common/text_file.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/residency/residency_registry.h"

#ifdef RUBATO_HAS_CUDA
#include "inference_rank/model/cuda_model.h"
#endif

namespace rubato {

Result<RubatoConfig> ResolveConfig(const ConfigOverrides& overrides) {
  RubatoConfig config = DefaultConfig();
  if (overrides.config_file) {
    RUBATO_ASSIGN_OR_RETURN(config, LoadConfigFile(*overrides.config_file));
  }
  if (overrides.model_dir) config.model.path = *overrides.model_dir;
  if (overrides.random_weights) config.model.random_weights = true;
  if (overrides.backend) {
    if (*overrides.backend == "cpu") {
      config.engine.backend = EngineSection::Backend::kCpu;
    } else if (*overrides.backend == "cuda") {
      config.engine.backend = EngineSection::Backend::kCuda;
    } else {
      return InvalidArgumentError("--backend: '" + Excerpt(*overrides.backend) +
                                  "' is not one of cpu, cuda");
    }
  }
  if (overrides.policy) {
    config.policy.name = *overrides.policy;
    if (!overrides.config_file) config.policy.source = "command line";
  }
  if (overrides.kv_residency) {
    if (*overrides.kv_residency != "auto" && *overrides.kv_residency != "local" &&
        *overrides.kv_residency != "offloaded" && *overrides.kv_residency != "evicting" &&
        *overrides.kv_residency != "split_by_head" && *overrides.kv_residency != "placed") {
      return InvalidArgumentError("--kv-residency: '" + Excerpt(*overrides.kv_residency) +
                                  "' is not one of auto, local, offloaded, evicting, "
                                  "split_by_head, placed");
    }
    config.engine.kv_residency = *overrides.kv_residency;
  }
  // An old policy spelling fixes the residency: a different --kv-residency is a conflict, never
  // silently overridden.
  const std::optional<std::string_view> alias = OffloadedAliasOf(config.policy.name);
  if (overrides.kv_residency && alias && *overrides.kv_residency != "offloaded" &&
      *overrides.kv_residency != "auto") {
    const std::string given = overrides.policy
                                  ? "--policy " + config.policy.name
                                  : config.policy.source + ": policy.name " + config.policy.name;
    return InvalidArgumentError(given + " is --policy " + std::string(*alias) +
                                " on offloaded KV; it conflicts with --kv-residency " +
                                *overrides.kv_residency + " (use --policy " + std::string(*alias) +
                                " --kv-residency " + *overrides.kv_residency + ")");
  }
  if (overrides.threads) config.engine.threads = *overrides.threads;
  if (overrides.cache_endpoint) {
    config.topology.mode = TopologySection::Mode::kDisaggregated;
    // "a,b,c": one cache rank each, requests placed by free budget.
    config.topology.cache_endpoints.clear();
    const std::string& list = *overrides.cache_endpoint;
    for (size_t begin = 0;;) {
      const size_t comma = list.find(',', begin);
      const std::string endpoint =
          list.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
      if (endpoint.empty()) {
        return InvalidArgumentError("--cache '" + list + "': cache rank " +
                                    std::to_string(config.topology.cache_endpoints.size()) +
                                    " is empty (a comma-separated list of host:port)");
      }
      config.topology.cache_endpoints.push_back(endpoint);
      if (comma == std::string::npos) break;
      begin = comma + 1;
    }
    // Over UCX unless the config file chose NCCL.
    if (config.topology.transport != TopologySection::Transport::kNccl) {
      config.topology.transport = TopologySection::Transport::kUcx;
    }
  }
  return config;
}

Status CheckSupportedByThisBuild(const RubatoConfig& config) {
  if (config.engine.backend == EngineSection::Backend::kCuda) {
#ifndef RUBATO_HAS_CUDA
    return UnsupportedError(
        "engine.backend 'cuda': this rubato was built without CUDA (configure with "
        "-DRUBATO_CUDA=ON)");
#endif
    if (config.engine.dtype != DType::kBF16) {
      return UnsupportedError("engine.dtype '" + std::string(DTypeName(config.engine.dtype)) +
                              "': the CUDA backend stores weights and KV in bf16 only");
    }
  }
  return Status::Ok();
}

Status CheckOffloadChoice(const RubatoConfig& config, const PolicyChoice& policy) {
  const bool disaggregated = config.topology.mode == TopologySection::Mode::kDisaggregated;
  if (!policy.offload.has_value()) {
    if (disaggregated) {
      return InvalidArgumentError(
          "a cache rank (--cache / topology.mode disaggregated) holds offloaded KV: use "
          "--kv-residency offloaded (engine.kv_residency; the old spellings --policy "
          "offload_dense / offload_topk still work), not local KV with '" +
          policy.name + "'");
    }
    return Status::Ok();
  }
  if (disaggregated && config.topology.cache_endpoints.empty()) {
    return InvalidArgumentError(
        "topology.mode disaggregated needs topology.cache_endpoints "
        "(\"host:port\" of a `rubato cache --listen`) or --cache");
  }
  if (disaggregated && config.topology.transport != TopologySection::Transport::kUcx &&
      config.topology.transport != TopologySection::Transport::kNccl) {
    return UnsupportedError("topology.transport '" +
                            std::string(ConfigEnumName(config.topology.transport)) +
                            "': a cache rank in another process is reached over ucx or nccl");
  }
  return Status::Ok();
}

Result<std::shared_ptr<Residency>> MakeResidency(const RubatoConfig& config,
                                                 const PolicyChoice& policy,
                                                 const ModelConfig& model) {
  ResidencySetup setup;
  setup.policy = policy.policy.get();
  setup.model = &model;
  setup.config = &config;
  return CreateResidency(
      policy.residency_name.empty() ? KvResidencyName(policy.residency) : policy.residency_name,
      setup);
}

Result<std::unique_ptr<Model>> LoadModel(const RubatoConfig& config,
                                         const std::filesystem::path& model_dir) {
  if (config.engine.backend == EngineSection::Backend::kCuda) {
#ifdef RUBATO_HAS_CUDA
    CudaModelOptions options;
    options.random_weights = config.model.random_weights;
    options.seed = config.model.seed;
    options.device = config.engine.device;
    return LoadCudaModel(model_dir, options);
#else
    return UnsupportedError("engine.backend 'cuda': this rubato was built without CUDA");
#endif
  }
  ModelLoadOptions options;
  options.random_weights = config.model.random_weights;
  options.seed = config.model.seed;
  options.num_threads = config.engine.threads;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<CpuModel> model, CpuModel::Load(model_dir, options));
  return std::unique_ptr<Model>(std::move(model));
}

EngineOptions EngineOptionsFromConfig(const RubatoConfig& config) {
  EngineOptions options;
  options.max_batch = config.engine.max_batch;
  options.max_context = config.engine.max_context;
  options.block_size = config.engine.block_size;
  options.prefill_chunk = config.engine.prefill_chunk;
  options.num_threads = config.engine.threads;
  options.gpu_memory_utilization = config.engine.gpu_memory_utilization;
  // Whole blocks: the config's range keeps the count within an int.
  options.max_kv_blocks = static_cast<int>(
      (config.engine.kv_pool_tokens + config.engine.block_size - 1) / config.engine.block_size);
  return options;
}

Status ApplyPolicy(const PolicyChoice& policy, const Tokenizer* tokenizer, EngineOptions& options) {
  RUBATO_RETURN_IF_ERROR(policy.policy->UseTokenizer(tokenizer));
  options.policy = policy.policy;
  return Status::Ok();
}

Result<PolicyChoice> ResolveAndCheck(const RubatoConfig& config) {
  RUBATO_ASSIGN_OR_RETURN(PolicyChoice policy, ResolvePolicy(config));
  RUBATO_RETURN_IF_ERROR(CheckSupportedByThisBuild(config));
  RUBATO_RETURN_IF_ERROR(CheckOffloadChoice(config, policy));
  std::error_code error;  // the throwing overload reported a long path as "internal error"
  if (!std::filesystem::is_directory(config.model.path, error)) {
    return NotFoundError("model directory '" + DisplayPath(config.model.path) + "' does not exist");
  }
  return policy;
}

}  // namespace rubato
