// The rubato YAML config: schema, validation and formatting (see config.h).
//
// Each section has one Read* function listing its keys with their ranges; YamlMapReader does
// the type checks and writes the messages. yaml-cpp reports syntax errors by exception: they
// are caught in ParseConfig and returned with the line and column.
#include "common/config.h"

#include <fmt/format.h>
#include <yaml-cpp/eventhandler.h>

#include <cctype>
#include <climits>
#include <cstdint>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "common/json_limits.h"
#include "common/policy_params.h"
#include "common/text_file.h"

namespace rubato {
namespace {

template <typename Enum>
using EnumName = std::pair<std::string_view, Enum>;

constexpr EnumName<EngineSection::Backend> kBackends[] = {{"cpu", EngineSection::Backend::kCpu},
                                                          {"cuda", EngineSection::Backend::kCuda}};
constexpr EnumName<DType> kDTypes[] = {
    {"f32", DType::kF32}, {"bf16", DType::kBF16}, {"f16", DType::kF16}};
constexpr EnumName<TopologySection::Mode> kModes[] = {
    {"colocated", TopologySection::Mode::kColocated},
    {"disaggregated", TopologySection::Mode::kDisaggregated}};
constexpr EnumName<TopologySection::Transport> kTransports[] = {
    {"loopback", TopologySection::Transport::kLoopback},
    {"ucx", TopologySection::Transport::kUcx},
    {"nccl", TopologySection::Transport::kNccl}};
constexpr EnumName<RankSpec::Role> kRoles[] = {{"inference", RankSpec::Role::kInference},
                                               {"cache", RankSpec::Role::kCache}};
constexpr EnumName<CacheSection::Memory> kCacheMemories[] = {
    {"pageable", CacheSection::Memory::kPageable},
    {"pinned", CacheSection::Memory::kPinned},
    {"device", CacheSection::Memory::kDevice}};
constexpr EnumName<std::string_view> kLogLevels[] = {{"trace", "trace"}, {"debug", "debug"},
                                                     {"info", "info"},   {"warn", "warn"},
                                                     {"error", "error"}, {"off", "off"}};
constexpr EnumName<std::string_view> kMetricsNames[] = {
    {"rubato", "rubato"}, {"vllm", "vllm"}, {"both", "both"}};

template <typename Enum, size_t N>
std::string_view NameOf(const EnumName<Enum> (&table)[N], Enum value) {
  for (const auto& [name, entry] : table) {
    if (entry == value) return name;
  }
  return "?";
}

constexpr int kMaxContextTokens = 16'777'216;
constexpr int64_t kMaxKvPoolTokens = int64_t{1} << 34;  // 2^30 blocks of 16

Status ReadModel(YamlMapReader& reader, ModelSection* model) {
  RUBATO_RETURN_IF_ERROR(reader.ReadNonEmptyString("path", &model->path));
  RUBATO_RETURN_IF_ERROR(reader.ReadBool("random_weights", &model->random_weights));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("seed", 0, INT64_MAX, &model->seed));
  return reader.Finish();
}

Status ReadEngine(YamlMapReader& reader, EngineSection* engine) {
  RUBATO_RETURN_IF_ERROR(reader.ReadEnum("backend", kBackends, &engine->backend));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("device", 0, 1023, &engine->device));
  RUBATO_RETURN_IF_ERROR(reader.ReadEnum("dtype", kDTypes, &engine->dtype));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("max_batch", 1, 4096, &engine->max_batch));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("max_context", 0, kMaxContextTokens, &engine->max_context));
  if (engine->max_context != 0 && engine->max_context < 16) {
    return reader.Error("max_context",
                        fmt::format("must be 0 (the model's max_position_embeddings) or in [16, "
                                    "{}], got {}",
                                    kMaxContextTokens, engine->max_context));
  }
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("block_size", INT_MIN, INT_MAX, &engine->block_size));
  if (engine->block_size != 16 && engine->block_size != 64) {
    return reader.Error("block_size", fmt::format("must be 16 or 64, got {}", engine->block_size));
  }
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("prefill_chunk", 1, 1 << 20, &engine->prefill_chunk));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("threads", 0, 1024, &engine->threads));
  RUBATO_RETURN_IF_ERROR(reader.ReadDouble("gpu_memory_utilization",
                                           DoubleRange{0, 1, /*min_inclusive=*/false, true},
                                           &engine->gpu_memory_utilization));
  RUBATO_RETURN_IF_ERROR(
      reader.ReadInt64("kv_pool_tokens", 0, kMaxKvPoolTokens, &engine->kv_pool_tokens));
  RUBATO_RETURN_IF_ERROR(reader.ReadString("kv_residency", &engine->kv_residency));
  if (engine->kv_residency != "auto" && engine->kv_residency != "local" &&
      engine->kv_residency != "offloaded" && engine->kv_residency != "evicting" &&
      engine->kv_residency != "split_by_head" && engine->kv_residency != "placed") {
    return reader.Error("kv_residency",
                        "must be auto, local, offloaded, evicting, split_by_head or placed, got '" +
                            engine->kv_residency + "'");
  }
  return reader.Finish();
}

Status ReadPolicy(YamlMapReader& reader, PolicySection* policy) {
  policy->source = reader.source();
  policy->key_path = reader.key_path();
  const bool has_name = reader.Has("name");
  RUBATO_RETURN_IF_ERROR(reader.ReadNonEmptyString("name", &policy->name));
  policy->params = reader.TakeRemaining();
  RUBATO_RETURN_IF_ERROR(CheckPolicyParamKeys(policy->params, reader.source(), reader.key_path()));
  if (!has_name && policy->params.size() > 0) {
    std::string keys;
    for (auto it = policy->params.begin(); it != policy->params.end(); ++it) {
      keys += (keys.empty() ? "" : ", ") + it->first.Scalar();
    }
    return reader.Error("name",
                        "missing; it is required when the section sets policy "
                        "parameters (" +
                            keys + ")");
  }
  return Status::Ok();
}

// "host:port" with a non-empty host and a port in [1, 65535].
bool IsHostPort(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == endpoint.size()) return false;
  int port = 0;
  for (size_t i = colon + 1; i < endpoint.size(); ++i) {
    if (endpoint[i] < '0' || endpoint[i] > '9' || port > 65535) return false;
    port = port * 10 + (endpoint[i] - '0');
  }
  return port >= 1 && port <= 65535;
}

Status ReadTopology(YamlMapReader& reader, TopologySection* topology) {
  RUBATO_RETURN_IF_ERROR(reader.ReadEnum("mode", kModes, &topology->mode));
  RUBATO_RETURN_IF_ERROR(reader.ReadEnum("transport", kTransports, &topology->transport));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("pack_layers", 1, 1024, &topology->pack_layers));
  RUBATO_RETURN_IF_ERROR(reader.ReadBool("delta_replies", &topology->delta_replies));
  RUBATO_RETURN_IF_ERROR(reader.ReadStringList("cache_endpoints", &topology->cache_endpoints));
  for (size_t i = 0; i < topology->cache_endpoints.size(); ++i) {
    if (!IsHostPort(topology->cache_endpoints[i])) {
      return reader.Error(fmt::format("cache_endpoints[{}]", i),
                          "expected host:port with a port in [1, 65535], got '" +
                              topology->cache_endpoints[i] + "'");
    }
  }
  RUBATO_ASSIGN_OR_RETURN(std::vector<YamlMapReader> rank_readers, reader.ReadMapList("ranks"));
  topology->ranks.clear();
  for (YamlMapReader& entry : rank_readers) {
    RankSpec spec;
    for (const char* key : {"rank", "role"}) {
      if (!entry.Has(key)) {
        return entry.Error(key, "missing; every entry needs rank and role");
      }
    }
    RUBATO_RETURN_IF_ERROR(entry.ReadInt("rank", 0, INT_MAX, &spec.rank));
    RUBATO_RETURN_IF_ERROR(entry.ReadEnum("role", kRoles, &spec.role));
    RUBATO_RETURN_IF_ERROR(entry.Finish());
    for (size_t j = 0; j < topology->ranks.size(); ++j) {
      if (topology->ranks[j].rank == spec.rank) {
        return entry.Error("rank", fmt::format("rank {} is already listed in {}.ranks[{}]",
                                               spec.rank, reader.key_path(), j));
      }
    }
    topology->ranks.push_back(spec);
  }
  return reader.Finish();
}

constexpr double kMaxCacheBudgetGib = 1 << 20;

Status ReadCache(YamlMapReader& reader, CacheSection* cache) {
  RUBATO_RETURN_IF_ERROR(reader.ReadDouble(
      "budget_gib", DoubleRange{0, kMaxCacheBudgetGib, /*min_inclusive=*/false, true},
      &cache->budget_gib));
  if (cache->budget_bytes() == 0) {
    return reader.Error("budget_gib", fmt::format("{} GiB is less than a byte", cache->budget_gib));
  }
  RUBATO_RETURN_IF_ERROR(reader.ReadEnum("memory", kCacheMemories, &cache->memory));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("device", -1, 1023, &cache->device));
  return reader.Finish();
}

Status ReadServer(YamlMapReader& reader, ServerSection* server) {
  RUBATO_RETURN_IF_ERROR(reader.ReadNonEmptyString("host", &server->host));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("port", 1, 65535, &server->port));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("metrics_port", 0, 65535, &server->metrics_port));
  RUBATO_RETURN_IF_ERROR(
      reader.ReadStringList("cors_allowed_origins", &server->cors_allowed_origins));
  for (size_t i = 0; i < server->cors_allowed_origins.size(); ++i) {
    const std::string& origin = server->cors_allowed_origins[i];
    const bool web = origin.starts_with("http://") || origin.starts_with("https://");
    if (origin != "*" && (!web || origin.ends_with("/"))) {
      return reader.Error(fmt::format("cors_allowed_origins[{}]", i),
                          "must be \"*\" or an origin like \"https://example.com\" (scheme, "
                          "host, optional port, no path), got '" +
                              origin + "'");
    }
  }
  RUBATO_RETURN_IF_ERROR(
      reader.ReadDouble("shutdown_grace_s", DoubleRange{0, 86400}, &server->shutdown_grace_s));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("request_threads", 0, 256, &server->request_threads));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("request_queue", 1, 100'000, &server->request_queue));
  std::string_view metrics_names = server->metrics_names;
  RUBATO_RETURN_IF_ERROR(reader.ReadEnum("metrics_names", kMetricsNames, &metrics_names));
  server->metrics_names = std::string(metrics_names);
  RUBATO_RETURN_IF_ERROR(reader.ReadString("api_key", &server->api_key));
  RUBATO_RETURN_IF_ERROR(
      reader.ReadBool("api_key_protects_metrics", &server->api_key_protects_metrics));
  if (server->metrics_port != 0 && server->metrics_port == server->port) {
    return reader.Error("metrics_port", fmt::format("must differ from {} ({})",
                                                    reader.KeyPath("port"), server->port));
  }
  return reader.Finish();
}

Status ReadLimits(YamlMapReader& reader, const EngineSection& engine, LimitsSection* limits) {
  RUBATO_RETURN_IF_ERROR(
      reader.ReadInt("max_prompt_tokens", 0, kMaxContextTokens, &limits->max_prompt_tokens));
  if (engine.max_context != 0 && limits->max_prompt_tokens > engine.max_context) {
    return reader.Error("max_prompt_tokens",
                        fmt::format("{} exceeds engine.max_context ({})", limits->max_prompt_tokens,
                                    engine.max_context));
  }
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("max_queue", 1, 1'000'000, &limits->max_queue));
  RUBATO_RETURN_IF_ERROR(reader.ReadDouble("request_timeout_s",
                                           DoubleRange{0, 86400, /*min_inclusive=*/false, true},
                                           &limits->request_timeout_s));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("rpc_timeout_ms", 1, 600'000, &limits->rpc_timeout_ms));
  RUBATO_RETURN_IF_ERROR(reader.ReadInt("heartbeat_ms", 1, 600'000, &limits->heartbeat_ms));
  return reader.Finish();
}

Status ReadLogging(YamlMapReader& reader, LoggingSection* logging) {
  std::string_view level = logging->level;
  RUBATO_RETURN_IF_ERROR(reader.ReadEnum("level", kLogLevels, &level));
  logging->level = std::string(level);
  return reader.Finish();
}

Result<RubatoConfig> ReadConfig(const YAML::Node& root, const std::string& source) {
  RubatoConfig config;
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader top, YamlMapReader::Open(root, "", source));
  // Sections in file order of the schema; the limits check against the engine's max_context.
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader model, top.ReadMap("model"));
  RUBATO_RETURN_IF_ERROR(ReadModel(model, &config.model));
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader engine, top.ReadMap("engine"));
  RUBATO_RETURN_IF_ERROR(ReadEngine(engine, &config.engine));
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader policy, top.ReadMap("policy"));
  RUBATO_RETURN_IF_ERROR(ReadPolicy(policy, &config.policy));
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader topology, top.ReadMap("topology"));
  RUBATO_RETURN_IF_ERROR(ReadTopology(topology, &config.topology));
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader cache, top.ReadMap("cache"));
  RUBATO_RETURN_IF_ERROR(ReadCache(cache, &config.cache));
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader server, top.ReadMap("server"));
  RUBATO_RETURN_IF_ERROR(ReadServer(server, &config.server));
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader limits, top.ReadMap("limits"));
  RUBATO_RETURN_IF_ERROR(ReadLimits(limits, config.engine, &config.limits));
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader logging, top.ReadMap("logging"));
  RUBATO_RETURN_IF_ERROR(ReadLogging(logging, &config.logging));
  RUBATO_RETURN_IF_ERROR(top.Finish());
  return config;
}

// Sees a YAML stream's events without building anything: where the last document started.
class DocumentStarts final : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override { last_start = mark; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}

  YAML::Mark last_start;
};

// The number of YAML documents in `text`. Not YAML::LoadAll: on a ',' outside any [] or {} ("," or
// "[a], b") yaml-cpp's parser (0.7, 0.8) never consumes the token and reports one more null
// document each turn, so LoadAll allocated until the machine ran out of memory. A document that
// starts where the previous one did is that case, and an error at its line and column. Throws
// yaml-cpp's ParserException on other syntax errors, as Load does.
Result<size_t> CountYamlDocuments(std::string_view text, const std::string& source) {
  std::istringstream stream{std::string(text)};
  YAML::Parser parser(stream);
  DocumentStarts starts;
  size_t documents = 0;
  std::optional<int> previous_start;
  while (parser.HandleNextDocument(starts)) {
    const YAML::Mark& mark = starts.last_start;
    if (previous_start == mark.pos) {
      const bool printable = mark.pos >= 0 && static_cast<size_t>(mark.pos) < text.size() &&
                             std::isgraph(static_cast<unsigned char>(text[mark.pos])) != 0;
      return InvalidArgumentError(
          fmt::format("{}: line {}, column {}: YAML syntax error: unexpected {}", source,
                      mark.line + 1, mark.column + 1,
                      printable ? fmt::format("'{}'", text[mark.pos]) : std::string("character")));
    }
    previous_start = mark.pos;
    ++documents;
  }
  return documents;
}

}  // namespace

Result<YamlMapReader> PolicySection::ParamsReader() const {
  return YamlMapReader::Open(params, key_path, source);
}

bool PolicySection::operator==(const PolicySection& other) const {
  return name == other.name && YAML::Dump(params) == YAML::Dump(other.params);
}

uint64_t CacheSection::budget_bytes() const {
  return static_cast<uint64_t>(budget_gib * static_cast<double>(uint64_t{1} << 30));
}

RubatoConfig DefaultConfig() { return RubatoConfig(); }

Result<RubatoConfig> ParseConfig(std::string_view yaml_text, const std::string& source) {
  RUBATO_RETURN_IF_ERROR(CheckYamlFlowNesting(yaml_text, source));
  try {
    RUBATO_ASSIGN_OR_RETURN(const size_t documents, CountYamlDocuments(yaml_text, source));
    if (documents > 1) {
      return InvalidArgumentError(fmt::format(
          "{}: expected one YAML document, found {} (separated by ---)", source, documents));
    }
    return ReadConfig(documents == 0 ? YAML::Node() : YAML::Load(std::string(yaml_text)), source);
  } catch (const YAML::ParserException& e) {
    return InvalidArgumentError(fmt::format("{}: line {}, column {}: YAML syntax error: {}", source,
                                            e.mark.line + 1, e.mark.column + 1, e.msg));
  } catch (const std::exception& e) {  // yaml-cpp misuse or allocation failure: still a value
    return InternalError(source + ": unexpected error while reading the config: " + e.what());
  }
}

Result<RubatoConfig> LoadConfigFile(const std::filesystem::path& path) {
  RUBATO_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path, kMaxConfigFileBytes));
  return ParseConfig(text, DisplayPath(path));
}

std::string_view ConfigEnumName(EngineSection::Backend backend) {
  return NameOf(kBackends, backend);
}
std::string_view ConfigEnumName(TopologySection::Mode mode) { return NameOf(kModes, mode); }
std::string_view ConfigEnumName(TopologySection::Transport transport) {
  return NameOf(kTransports, transport);
}
std::string_view ConfigEnumName(RankSpec::Role role) { return NameOf(kRoles, role); }
std::string_view ConfigEnumName(CacheSection::Memory memory) {
  return NameOf(kCacheMemories, memory);
}

std::string FormatConfigYaml(const RubatoConfig& config) {
  YAML::Emitter out;
  auto key = [&out](const char* name) -> YAML::Emitter& {
    return out << YAML::Key << name << YAML::Value;
  };
  auto text = [](std::string_view value) { return std::string(value); };
  out << YAML::BeginMap;

  key("model") << YAML::BeginMap;
  key("path") << YAML::DoubleQuoted << config.model.path;
  key("random_weights") << config.model.random_weights;
  key("seed") << config.model.seed;
  out << YAML::EndMap;

  const EngineSection& engine = config.engine;
  key("engine") << YAML::BeginMap;
  key("backend") << text(ConfigEnumName(engine.backend));
  key("device") << engine.device;
  key("dtype") << text(NameOf(kDTypes, engine.dtype));
  key("max_batch") << engine.max_batch;
  key("max_context") << engine.max_context;
  key("block_size") << engine.block_size;
  key("prefill_chunk") << engine.prefill_chunk;
  key("threads") << engine.threads;
  key("gpu_memory_utilization") << fmt::format("{}", engine.gpu_memory_utilization);
  key("kv_pool_tokens") << engine.kv_pool_tokens;
  key("kv_residency") << engine.kv_residency;
  out << YAML::EndMap;

  key("policy") << YAML::BeginMap;
  key("name") << YAML::DoubleQuoted << config.policy.name;
  WritePolicyParams(out, config.policy.params);
  out << YAML::EndMap;

  const TopologySection& topology = config.topology;
  key("topology") << YAML::BeginMap;
  key("mode") << text(ConfigEnumName(topology.mode));
  key("transport") << text(ConfigEnumName(topology.transport));
  key("pack_layers") << topology.pack_layers;
  key("delta_replies") << topology.delta_replies;
  key("cache_endpoints") << YAML::Flow << YAML::BeginSeq;
  for (const std::string& endpoint : topology.cache_endpoints)
    out << YAML::DoubleQuoted << endpoint;
  out << YAML::EndSeq;
  // An empty block sequence would print as "ranks:\n    []"; a flow one prints "ranks: []".
  key("ranks") << (topology.ranks.empty() ? YAML::Flow : YAML::Block) << YAML::BeginSeq;
  for (const RankSpec& spec : topology.ranks) {
    out << YAML::Flow << YAML::BeginMap;
    key("rank") << spec.rank;
    key("role") << text(ConfigEnumName(spec.role));
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::EndMap;

  key("cache") << YAML::BeginMap;
  key("budget_gib") << fmt::format("{}", config.cache.budget_gib);
  key("memory") << text(ConfigEnumName(config.cache.memory));
  key("device") << config.cache.device;
  out << YAML::EndMap;

  key("server") << YAML::BeginMap;
  key("host") << YAML::DoubleQuoted << config.server.host;
  key("port") << config.server.port;
  key("metrics_port") << config.server.metrics_port;
  key("cors_allowed_origins") << YAML::Flow << YAML::BeginSeq;
  for (const std::string& origin : config.server.cors_allowed_origins)
    out << YAML::DoubleQuoted << origin;
  out << YAML::EndSeq;
  key("shutdown_grace_s") << fmt::format("{}", config.server.shutdown_grace_s);
  key("request_threads") << config.server.request_threads;
  key("request_queue") << config.server.request_queue;
  key("metrics_names") << config.server.metrics_names;
  key("api_key") << YAML::DoubleQuoted << config.server.api_key;
  key("api_key_protects_metrics") << config.server.api_key_protects_metrics;
  out << YAML::EndMap;

  const LimitsSection& limits = config.limits;
  key("limits") << YAML::BeginMap;
  key("max_prompt_tokens") << limits.max_prompt_tokens;
  key("max_queue") << limits.max_queue;
  key("request_timeout_s") << fmt::format("{}", limits.request_timeout_s);
  key("rpc_timeout_ms") << limits.rpc_timeout_ms;
  key("heartbeat_ms") << limits.heartbeat_ms;
  out << YAML::EndMap;

  key("logging") << YAML::BeginMap;
  key("level") << config.logging.level;
  out << YAML::EndMap;

  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace rubato
