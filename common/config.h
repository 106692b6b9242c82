// The rubato YAML config (docs/design.md §6): one file, validated at load. Unknown keys, wrong
// types, out-of-range values and bad enum values are errors naming the file and the key path, e.g.
// "rubato.yaml: engine.max_batch: must be in [1, 4096], got 0 (line 7)". Missing keys take the
// defaults below (configs/default.yaml spells them out); an empty file is the default config.
//
// The policy section is validated only for `name`; its other keys are kept as a YAML map for
// the policy factory, which reads them with PolicySection::ParamsReader() so that its errors
// name e.g. "policy.recent_window" in the same form.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "common/yaml_map_reader.h"

namespace rubato {

struct ModelSection {
  std::string path = "models/tiny-qwen3-random";  // Hugging Face model directory
  bool random_weights = false;                    // build weights randomly from path/config.json
  uint64_t seed = 0;                              // seed for random_weights, [0, 2^63)

  bool operator==(const ModelSection&) const = default;
};

struct EngineSection {
  enum class Backend { kCpu, kCuda };

  Backend backend = Backend::kCpu;
  int device = 0;              // GPU index (cuda), [0, 1023]
  DType dtype = DType::kBF16;  // storage dtype on the GPU backend (the CPU computes in fp32)
  int max_batch = 8;           // [1, 4096] running requests
  int max_context = 0;         // 0: the model's max_position_embeddings; else [16, 16777216]
  int block_size = 16;         // 16 or 64 tokens per KV block
  int prefill_chunk = 512;     // [1, 1048576] tokens per prefill chunk
  int threads = 0;             // CPU threads, 0: all cores; [0, 1024]
  // (0, 1]: the share of the memory the KV pool lives in (the GPU's; host memory for the CPU
  // backend) this process may fill, weights included; the pool takes what is left (vLLM's).
  double gpu_memory_utilization = 0.9;
  // 0: the pool is sized by gpu_memory_utilization; else [1, 2^34] tokens, rounded up to whole
  // blocks (a fixed pool, e.g. a small one in tests).
  int64_t kv_pool_tokens = 0;
  // Where requests' full KV lives: "local" (this rank's cache), "offloaded" (a cache rank,
  // topology.cache_endpoints or one in this process) or "evicting" (a fixed budget of slots
  // per request, one overwritten per step). Apart from the policy, which must
  // support it. "auto": offloaded with a cache rank (topology.mode disaggregated), else local
  // when the policy supports it, else the one residency the policy supports.
  std::string kv_residency = "auto";

  bool operator==(const EngineSection&) const = default;
};

struct PolicySection {
  std::string name = "dense";  // non-empty; which policy the factory builds
  // The policy's parameters: every other key of the section, unvalidated. Copies of a
  // PolicySection share this node (yaml-cpp semantics); treat it as read-only.
  YAML::Node params{YAML::NodeType::Map};
  std::string key_path = "policy";        // prefix of the parameters' key paths in errors
  std::string source = "default config";  // the file the section came from, for errors

  // A reader over `params` whose errors read "<source>: policy.<key>: ...". Call Finish() on
  // it after reading every parameter the policy knows, to reject unknown ones.
  Result<YamlMapReader> ParamsReader() const;

  // Compares name and params (by content); key_path and source say where, not what.
  bool operator==(const PolicySection& other) const;
};

struct RankSpec {
  enum class Role { kInference, kCache };

  int rank = 0;  // MPI rank (or process index), >= 0, unique within topology.ranks
  Role role = Role::kInference;

  bool operator==(const RankSpec&) const = default;
};

struct TopologySection {
  enum class Mode { kColocated, kDisaggregated };
  enum class Transport { kLoopback, kUcx, kNccl };

  Mode mode = Mode::kColocated;
  Transport transport = Transport::kLoopback;
  int pack_layers = 4;  // [1, 1024] layers per layer pack
  // Replies of a selector that replies rows (oracle_topk) carry only the rows entering each
  // selection (false: every selected row every step, for comparing bytes).
  bool delta_replies = true;
  std::vector<std::string> cache_endpoints;  // "host:port" of cache ranks' RPC servers
  std::vector<RankSpec> ranks;               // role per rank when launched by mpirun

  bool operator==(const TopologySection&) const = default;
};

// A cache rank's KV storage: what the colocated cache rank, `rubato cache` (its flags override
// these) and the cache role under mpirun keep offloaded KV in.
struct CacheSection {
  enum class Memory { kPageable, kPinned, kDevice };

  // (0, 1048576] GiB of KV that all sessions of a cache rank may reserve; a session past it is
  // refused naming the budget.
  double budget_gib = 4;
  // pageable host memory, pinned (page-locked, CUDA builds) or device (the GPU `device`).
  Memory memory = Memory::kPageable;
  // The cache rank's GPU, [-1, 1023]; -1: the mode's (the colocated mode: engine.device; `rubato
  // cache`: 0; under mpirun: the node-local rank).
  int device = -1;

  uint64_t budget_bytes() const;  // budget_gib in bytes, rounded down
  bool operator==(const CacheSection&) const = default;
};

struct ServerSection {
  std::string host = "127.0.0.1";
  int port = 8000;       // [1, 65535] OpenAI-compatible HTTP API
  int metrics_port = 0;  // [0, 65535] a second listener for /metrics only, 0: off; != port
  // Origins allowed to call the API from a browser (CORS): "*" or "http(s)://host[:port]";
  // empty: no CORS headers (browsers refuse cross-origin calls).
  std::vector<std::string> cors_allowed_origins;
  // [0, 86400] seconds requests in flight get to finish after SIGTERM / SIGINT; those still
  // running then end with an error (503, or an SSE error event).
  double shutdown_grace_s = 30;
  // [0, 256] threads that parse, template and tokenize request bodies off the HTTP I/O thread;
  // 0: min(4, hardware threads).
  int request_threads = 0;
  // [1, 100000] requests that may wait for one of those threads; past it: 429 with Retry-After.
  int request_queue = 64;
  // Names of the serving series that vLLM also exposes: "rubato" (rubato:...), "vllm" (vLLM's
  // own names and labels, for its dashboards) or "both".
  std::string metrics_names = "rubato";
  // Set: /v1/* needs `Authorization: Bearer <api_key>` (401 otherwise), as `vllm serve
  // --api-key`; --api-key and RUBATO_API_KEY override it. /health stays open (probes); /metrics
  // too unless api_key_protects_metrics.
  std::string api_key;
  bool api_key_protects_metrics = false;

  bool operator==(const ServerSection&) const = default;
};

struct LimitsSection {
  int max_prompt_tokens = 0;       // 0: engine max_context; else [1, 16777216]
  int max_queue = 256;             // [1, 1000000] waiting requests
  double request_timeout_s = 600;  // (0, 86400]
  int rpc_timeout_ms = 5000;       // [1, 600000] deadline of one control-plane call
  int heartbeat_ms = 1000;         // [1, 600000] interval between peer heartbeats

  bool operator==(const LimitsSection&) const = default;
};

struct LoggingSection {
  std::string level = "warn";  // trace | debug | info | warn | error | off

  bool operator==(const LoggingSection&) const = default;
};

struct RubatoConfig {
  ModelSection model;
  EngineSection engine;
  PolicySection policy;
  TopologySection topology;
  CacheSection cache;
  ServerSection server;
  LimitsSection limits;
  LoggingSection logging;

  bool operator==(const RubatoConfig&) const = default;
};

// The configuration used when a file sets nothing (equal to configs/default.yaml).
RubatoConfig DefaultConfig();

// Parses and validates YAML text; `source` names it in errors ("rubato.yaml"). Never throws.
Result<RubatoConfig> ParseConfig(std::string_view yaml_text, const std::string& source);

// Reads and parses a config file; errors name the path.
Result<RubatoConfig> LoadConfigFile(const std::filesystem::path& path);

// The config as YAML that ParseConfig reads back to an equal config: every key, for logging
// the effective configuration at startup.
std::string FormatConfigYaml(const RubatoConfig& config);

// Lower-case names as written in the YAML: "cpu", "disaggregated", "nccl", "cache", ...
std::string_view ConfigEnumName(EngineSection::Backend backend);
std::string_view ConfigEnumName(TopologySection::Mode mode);
std::string_view ConfigEnumName(TopologySection::Transport transport);
std::string_view ConfigEnumName(RankSpec::Role role);
std::string_view ConfigEnumName(CacheSection::Memory memory);

}  // namespace rubato
