// Tests for the rubato YAML config: defaults (and configs/default.yaml), a full config, the
// policy parameters handed to the factory, and every kind of error naming file and key path.
#include "common/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "common/test_temp_dir.h"

namespace rubato {

// Prints configs as YAML in assertion failures.
void PrintTo(const RubatoConfig& config, std::ostream* os) { *os << FormatConfigYaml(config); }

namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kFullConfig[] = R"(# every key set to a non-default value
model:
  path: /models/Qwen3-8B
  random_weights: true
  seed: 1234
engine:
  backend: cuda
  device: 3
  dtype: f16
  max_batch: 64
  max_context: 131072
  block_size: 64
  prefill_chunk: 2048
  threads: 12
  gpu_memory_utilization: 0.85
  kv_pool_tokens: 65536
policy:
  name: sfi
  recent_window: 256
  trigger_strings: [".", "?", "\n"]
  selector: {alpha: 0.5, top_k: 2048}
topology:
  mode: disaggregated
  transport: nccl
  pack_layers: 8
  cache_endpoints: ["cache-0.rubato:7000", "10.0.0.2:7001"]
  ranks:
    - {rank: 0, role: inference}
    - {rank: 1, role: cache}
cache:
  budget_gib: 16.5
  memory: pinned
  device: 2
server:
  host: 0.0.0.0
  port: 8080
  metrics_port: 0
  cors_allowed_origins: ["https://chat.example.com", "*"]
  shutdown_grace_s: 2.5
  request_threads: 3
  request_queue: 9
  metrics_names: both
limits:
  max_prompt_tokens: 100000
  max_queue: 1000
  request_timeout_s: 12.5
  rpc_timeout_ms: 250
  heartbeat_ms: 50
logging:
  level: debug
)";

// Parses `yaml` as "rubato.yaml", expects an InvalidArgument error and returns its message.
std::string ConfigError(const std::string& yaml) {
  Result<RubatoConfig> result = ParseConfig(yaml, "rubato.yaml");
  EXPECT_FALSE(result.ok()) << yaml;
  if (result.ok()) return "";
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << result.status().message();
  return result.status().message();
}

TEST(Config, EmptyTextIsTheDefaultConfig) {
  for (const char* text : {"", "\n", "# only a comment\n", "---\n"}) {
    auto config = ParseConfig(text, "rubato.yaml");
    ASSERT_TRUE(config.ok()) << config.status().message();
    EXPECT_EQ(*config, DefaultConfig()) << "text: '" << text << "'";
  }
  const RubatoConfig defaults = DefaultConfig();
  EXPECT_EQ(defaults.model.path, "models/tiny-qwen3-random");
  EXPECT_EQ(defaults.engine.backend, EngineSection::Backend::kCpu);
  EXPECT_EQ(defaults.engine.dtype, DType::kBF16);
  EXPECT_EQ(defaults.engine.max_batch, 8);
  EXPECT_EQ(defaults.engine.block_size, 16);
  EXPECT_EQ(defaults.policy.name, "dense");
  EXPECT_EQ(defaults.policy.params.size(), 0u);
  EXPECT_EQ(defaults.server.port, 8000);
  EXPECT_EQ(defaults.limits.request_timeout_s, 600.0);
  EXPECT_EQ(defaults.logging.level, "warn");
}

TEST(Config, DefaultYamlFileEqualsDefaultConfig) {
  auto config = LoadConfigFile("configs/default.yaml");
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(*config, DefaultConfig());
}

// The launch configs next to default.yaml load, and the NCCL one asks for NCCL.
TEST(Config, TheShippedLaunchConfigsLoad) {
  for (const auto& [path, ranks] :
       {std::pair{"configs/disagg-mpi.yaml", 2u}, std::pair{"configs/disagg-mpi-nccl.yaml", 2u},
        std::pair{"configs/disagg-mpi-3cache.yaml", 4u},
        std::pair{"configs/disagg-mpi-device.yaml", 2u},
        std::pair{"configs/disagg-mpi-device-3cache.yaml", 4u}}) {
    auto config = LoadConfigFile(path);
    ASSERT_TRUE(config.ok()) << path << ": " << config.status().message();
    EXPECT_EQ(config->topology.mode, TopologySection::Mode::kDisaggregated) << path;
    EXPECT_EQ(config->topology.ranks.size(), ranks) << path;
  }
  auto nccl = LoadConfigFile("configs/disagg-mpi-nccl.yaml");
  ASSERT_TRUE(nccl.ok());
  EXPECT_EQ(nccl->topology.transport, TopologySection::Transport::kNccl);
  auto device = LoadConfigFile("configs/disagg-mpi-device-3cache.yaml");
  ASSERT_TRUE(device.ok());
  EXPECT_EQ(device->topology.transport, TopologySection::Transport::kNccl);
  EXPECT_EQ(device->cache.memory, CacheSection::Memory::kDevice);
}

// Collects "section.key" for every key of a two-level YAML map.
std::set<std::string> KeyPaths(const YAML::Node& root) {
  std::set<std::string> paths;
  for (auto section = root.begin(); section != root.end(); ++section) {
    const YAML::Node keys = section->second;
    for (auto key = keys.begin(); key != keys.end(); ++key) {
      paths.insert(section->first.Scalar() + "." + key->first.Scalar());
    }
  }
  return paths;
}

TEST(Config, DefaultYamlSpellsOutEveryKey) {
  const YAML::Node file = YAML::LoadFile("configs/default.yaml");
  const YAML::Node formatted = YAML::Load(FormatConfigYaml(DefaultConfig()));
  const std::set<std::string> expected = KeyPaths(formatted);
  EXPECT_EQ(KeyPaths(file), expected);
  EXPECT_EQ(expected.size(),
            40u);  // model 3, engine 11, policy 1, topology 6, cache 3, server 10, limits 5,
                   // logging 1
}

TEST(Config, ParsesEveryKey) {
  auto parsed = ParseConfig(kFullConfig, "full.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status().message();
  const RubatoConfig& config = *parsed;
  EXPECT_EQ(config.model.path, "/models/Qwen3-8B");
  EXPECT_TRUE(config.model.random_weights);
  EXPECT_EQ(config.model.seed, 1234u);
  EXPECT_EQ(config.engine.backend, EngineSection::Backend::kCuda);
  EXPECT_EQ(config.engine.device, 3);
  EXPECT_EQ(config.engine.dtype, DType::kF16);
  EXPECT_EQ(config.engine.max_batch, 64);
  EXPECT_EQ(config.engine.max_context, 131072);
  EXPECT_EQ(config.engine.block_size, 64);
  EXPECT_EQ(config.engine.prefill_chunk, 2048);
  EXPECT_EQ(config.engine.threads, 12);
  EXPECT_EQ(config.engine.gpu_memory_utilization, 0.85);
  EXPECT_EQ(config.engine.kv_pool_tokens, 65536);
  EXPECT_EQ(config.policy.name, "sfi");
  EXPECT_EQ(config.policy.params.size(), 3u);
  EXPECT_EQ(config.topology.mode, TopologySection::Mode::kDisaggregated);
  EXPECT_EQ(config.topology.transport, TopologySection::Transport::kNccl);
  EXPECT_EQ(config.topology.pack_layers, 8);
  EXPECT_TRUE(config.topology.delta_replies);
  EXPECT_EQ(config.topology.cache_endpoints,
            (std::vector<std::string>{"cache-0.rubato:7000", "10.0.0.2:7001"}));
  EXPECT_EQ(config.topology.ranks,
            (std::vector<RankSpec>{{0, RankSpec::Role::kInference}, {1, RankSpec::Role::kCache}}));
  EXPECT_EQ(config.cache.budget_gib, 16.5);
  EXPECT_EQ(config.cache.budget_bytes(), uint64_t{33} << 29);
  EXPECT_EQ(config.cache.memory, CacheSection::Memory::kPinned);
  EXPECT_EQ(config.cache.device, 2);
  EXPECT_EQ(config.server.host, "0.0.0.0");
  EXPECT_EQ(config.server.port, 8080);
  EXPECT_EQ(config.server.metrics_port, 0);
  EXPECT_EQ(config.server.cors_allowed_origins,
            (std::vector<std::string>{"https://chat.example.com", "*"}));
  EXPECT_EQ(config.server.shutdown_grace_s, 2.5);
  EXPECT_EQ(config.server.request_threads, 3);
  EXPECT_EQ(config.server.request_queue, 9);
  EXPECT_EQ(config.server.metrics_names, "both");
  EXPECT_EQ(config.limits.max_prompt_tokens, 100000);
  EXPECT_EQ(config.limits.max_queue, 1000);
  EXPECT_EQ(config.limits.request_timeout_s, 12.5);
  EXPECT_EQ(config.limits.rpc_timeout_ms, 250);
  EXPECT_EQ(config.limits.heartbeat_ms, 50);
  EXPECT_EQ(config.logging.level, "debug");
}

TEST(Config, FormatRoundTrips) {
  // Strings that would read back as other types unless the formatter quotes them.
  RubatoConfig tricky = DefaultConfig();
  tricky.model.path = "null";
  tricky.server.host = "8000";
  tricky.policy.name = "true";
  tricky.topology.cache_endpoints = {"~:1"};
  for (const RubatoConfig& config :
       {DefaultConfig(), *ParseConfig(kFullConfig, "full.yaml"), tricky}) {
    const std::string yaml = FormatConfigYaml(config);
    auto reparsed = ParseConfig(yaml, "formatted.yaml");
    ASSERT_TRUE(reparsed.ok()) << reparsed.status().message() << "\n" << yaml;
    EXPECT_EQ(*reparsed, config) << yaml;
  }
  EXPECT_NE(*ParseConfig(kFullConfig, "full.yaml"), DefaultConfig());
}

// A policy parameter keeps its text and its quoting through the formatter, also where yaml-cpp
// alone would write a quoted string plain and lose a carriage return (a fuzzer finding).
TEST(Config, FormattedPolicyParametersKeepTextQuotesAndAliases) {
  const char* yaml =
      "policy:\n"
      "  name: dense\n"
      "  budget: \"4\\r\"\n"
      "  quoted: \"64\"\n"
      "  plain: 64\n"
      "  shared: &a [x, \"y\\t\"]\n"
      "  again: *a\n";
  auto config = ParseConfig(yaml, "params.yaml");
  ASSERT_TRUE(config.ok()) << config.status().message();
  const std::string formatted = FormatConfigYaml(*config);
  auto reparsed = ParseConfig(formatted, "formatted.yaml");
  ASSERT_TRUE(reparsed.ok()) << reparsed.status().message() << "\n" << formatted;
  EXPECT_EQ(*reparsed, *config) << formatted;
  const YAML::Node& params = reparsed->policy.params;
  EXPECT_EQ(params["budget"].Scalar(), "4\r");
  EXPECT_EQ(params["quoted"].Tag(), "!") << formatted;  // still a string to the typed readers
  EXPECT_EQ(params["plain"].Tag(), "?") << formatted;
  EXPECT_TRUE(params["again"].is(params["shared"])) << formatted;

  // A plain scalar that keeps a carriage return only because the file ends after it.
  auto at_end = ParseConfig("policy:\n  name: sfi\n  t_max: &4 tioj\r", "params.yaml");
  ASSERT_TRUE(at_end.ok()) << at_end.status().message();
  ASSERT_EQ(at_end->policy.params["t_max"].Scalar(), "tioj\r");
  const std::string text = FormatConfigYaml(*at_end);
  auto again = ParseConfig(text, "formatted.yaml");
  ASSERT_TRUE(again.ok()) << again.status().message() << "\n" << text;
  EXPECT_EQ(*again, *at_end) << text;
}

// Policy parameter keys are names at any depth: a key of control characters (which YAML could
// not even read back once escaped past 1024 characters) is refused by name with its place.
TEST(Config, PolicyParameterKeysMustBeNames) {
  const std::string controls(400, '\x0b');
  auto top = ParseConfig("policy:\n  name: kascade\n  cali" + controls + "brate: 1\n", "k.yaml");
  ASSERT_FALSE(top.ok());
  EXPECT_THAT(top.status().message(),
              HasSubstr("k.yaml: policy: keys must be names of 1 to 128 characters"));
  EXPECT_THAT(top.status().message(), HasSubstr("(line 3)"));
  auto nested = ParseConfig(
      "policy:\n  name: sfi\n  a:\n    - {\"" + std::string(200, 'k') + "\": 2}\n", "k.yaml");
  ASSERT_FALSE(nested.ok());
  EXPECT_THAT(nested.status().message(), HasSubstr("k.yaml: policy.a[0]: keys must be names"));
  auto complex_key = ParseConfig("policy:\n  name: sfi\n  a:\n    ? [x, y]\n    : 4\n", "k.yaml");
  ASSERT_FALSE(complex_key.ok());
  EXPECT_THAT(complex_key.status().message(), HasSubstr("policy.a: keys must be names"));
  // Names of 128 characters, nested and aliased, still load and write back.
  const std::string name(128, 'n');
  auto fine =
      ParseConfig("policy:\n  name: sfi\n  a: &x {" + name + ": 1}\n  b: [*x, *x]\n", "k.yaml");
  ASSERT_TRUE(fine.ok()) << fine.status().message();
  auto again = ParseConfig(FormatConfigYaml(*fine), "formatted.yaml");
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(*again, *fine);
}

TEST(Config, PolicyParametersAreKeptForTheFactory) {
  auto config = ParseConfig(kFullConfig, "full.yaml");
  ASSERT_TRUE(config.ok()) << config.status().message();
  const PolicySection& policy = config->policy;
  EXPECT_EQ(policy.key_path, "policy");
  EXPECT_EQ(policy.source, "full.yaml");
  EXPECT_FALSE(policy.params["name"].IsDefined());

  auto reader = policy.ParamsReader();
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  int recent_window = 0;
  EXPECT_TRUE(reader->ReadInt("recent_window", 1, 1 << 20, &recent_window).ok());
  EXPECT_EQ(recent_window, 256);
  std::vector<std::string> triggers;
  EXPECT_TRUE(reader->ReadStringList("trigger_strings", &triggers).ok());
  EXPECT_EQ(triggers, (std::vector<std::string>{".", "?", "\n"}));
  // The factory's own checks read like the rest of the config, with the line of the key.
  EXPECT_EQ(reader->Error("recent_window", "must be at most 128").message(),
            "full.yaml: policy.recent_window: must be at most 128 (line 19)");
  // A parameter the policy does not know is reported by Finish.
  EXPECT_THAT(reader->Finish().message(), HasSubstr("full.yaml: policy.selector: unknown key"));
  auto selector = reader->ReadMap("selector");
  ASSERT_TRUE(selector.ok());
  double alpha = 0;
  EXPECT_TRUE(selector->ReadDouble("alpha", DoubleRange{0, 1}, &alpha).ok());
  EXPECT_EQ(alpha, 0.5);
  EXPECT_THAT(selector->Finish().message(),
              HasSubstr("full.yaml: policy.selector.top_k: unknown key"));
  EXPECT_TRUE(reader->Finish().ok());
}

TEST(Config, PolicyNameIsRequiredWithParametersAndNonEmpty) {
  EXPECT_THAT(ConfigError("policy:\n  recent_window: 5\n  budget: 8\n"),
              HasSubstr("rubato.yaml: policy.name: missing; it is required when the section sets "
                        "policy parameters (recent_window, budget)"));
  EXPECT_THAT(ConfigError("policy:\n  name: ''\n"),
              HasSubstr("rubato.yaml: policy.name: must not be empty (line 2)"));
  EXPECT_THAT(ConfigError("policy: sfi\n"),
              HasSubstr("rubato.yaml: policy: expected a map of settings, got 'sfi'"));
  auto named_only = ParseConfig("policy:\n  name: kascade\n", "rubato.yaml");
  ASSERT_TRUE(named_only.ok()) << named_only.status().message();
  EXPECT_EQ(named_only->policy.name, "kascade");
  EXPECT_EQ(named_only->policy.params.size(), 0u);
}

TEST(Config, UnknownKeysAreNamedWithASuggestion) {
  EXPECT_THAT(ConfigError("engine:\n  max_batch: 4\n  blocksize: 64\n"),
              HasSubstr("rubato.yaml: engine.blocksize: unknown key; did you mean 'block_size'? "
                        "(line 3)"));
  EXPECT_THAT(ConfigError("modle:\n  path: x\n"),
              HasSubstr("rubato.yaml: modle: unknown key; did you mean 'model'?"));
  EXPECT_THAT(ConfigError("server:\n  tls_certificate: a.pem\n"),
              HasSubstr("rubato.yaml: server.tls_certificate: unknown key; expected one of host, "
                        "port, metrics_port, cors_allowed_origins, shutdown_grace_s"));
  EXPECT_THAT(ConfigError("topology:\n  ranks:\n    - {rank: 0, role: cache, gpu: 1}\n"),
              HasSubstr("rubato.yaml: topology.ranks[0].gpu: unknown key"));
}

TEST(Config, WrongTypesNameTheKey) {
  struct Case {
    std::string yaml;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"server:\n  port: abc\n",
       "rubato.yaml: server.port: expected an integer, got 'abc' (line 2)"},
      {"server:\n  port: \"8000\"\n", "server.port: expected an integer, got the quoted string"},
      {"engine:\n  max_batch: 2.5\n", "engine.max_batch: expected an integer, got '2.5'"},
      {"engine:\n  max_batch:\n", "engine.max_batch: expected an integer, got null"},
      {"engine:\n  max_batch: [1, 2]\n", "engine.max_batch: expected an integer, got a list"},
      {"engine: 5\n", "rubato.yaml: engine: expected a map of settings, got '5'"},
      {"model:\n  random_weights: maybe\n",
       "model.random_weights: expected true or false, got 'maybe'"},
      {"model:\n  path: {a: 1}\n", "model.path: expected a string, got a map"},
      {"limits:\n  request_timeout_s: soon\n",
       "limits.request_timeout_s: expected a number, got 'soon'"},
      {"topology:\n  cache_endpoints: host:7000\n",
       "topology.cache_endpoints: expected a list of strings, got 'host:7000'"},
      {"topology:\n  cache_endpoints: [[a]]\n",
       "topology.cache_endpoints[0]: expected a string, got a list"},
      {"topology:\n  ranks: {rank: 0}\n", "topology.ranks: expected a list, got a map"},
      {"topology:\n  ranks: [3]\n", "topology.ranks[0]: expected a map, got '3'"},
      {"[1, 2]\n", "rubato.yaml: the document: expected a map of settings, got a list"},
  };
  for (const Case& c : cases) EXPECT_THAT(ConfigError(c.yaml), HasSubstr(c.expected)) << c.yaml;
}

TEST(Config, OutOfRangeValuesNameKeyRangeAndValue) {
  struct Case {
    std::string yaml;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"engine:\n  max_batch: 0\n", "rubato.yaml: engine.max_batch: must be in [1, 4096], got 0"},
      {"engine:\n  max_batch: 4097\n", "engine.max_batch: must be in [1, 4096], got 4097"},
      {"engine:\n  device: -1\n", "engine.device: must be in [0, 1023], got -1"},
      {"engine:\n  max_context: 8\n",
       "engine.max_context: must be 0 (the model's max_position_embeddings) or in [16, 16777216], "
       "got 8"},
      {"engine:\n  max_context: 16777217\n", "engine.max_context: must be in [0, 16777216]"},
      {"engine:\n  block_size: 32\n", "engine.block_size: must be 16 or 64, got 32"},
      {"engine:\n  prefill_chunk: 0\n", "engine.prefill_chunk: must be in [1, 1048576], got 0"},
      {"engine:\n  threads: 1025\n", "engine.threads: must be in [0, 1024], got 1025"},
      {"engine:\n  gpu_memory_utilization: 0\n",
       "engine.gpu_memory_utilization: must be in (0, 1], got 0"},
      {"engine:\n  gpu_memory_utilization: 1.01\n",
       "engine.gpu_memory_utilization: must be in (0, 1], got 1.01"},
      {"engine:\n  gpu_memory_utilization: -0.5\n",
       "engine.gpu_memory_utilization: must be in (0, 1], got -0.5"},
      {"engine:\n  kv_pool_tokens: -1\n",
       "engine.kv_pool_tokens: must be in [0, 17179869184], got -1"},
      {"model:\n  seed: -1\n", "model.seed: must be >= 0, got -1"},
      {"model:\n  seed: 99999999999999999999\n", "model.seed: must be >= 0, got 9999"},
      {"topology:\n  pack_layers: 0\n", "topology.pack_layers: must be in [1, 1024], got 0"},
      {"topology:\n  delta_replies: sometimes\n", "topology.delta_replies: expected"},
      {"server:\n  port: 0\n", "server.port: must be in [1, 65535], got 0"},
      {"server:\n  port: 65536\n", "server.port: must be in [1, 65535], got 65536"},
      {"server:\n  metrics_port: -1\n", "server.metrics_port: must be in [0, 65535], got -1"},
      {"server:\n  host: ''\n", "server.host: must not be empty"},
      {"server:\n  shutdown_grace_s: -1\n",
       "server.shutdown_grace_s: must be in [0, 86400], got -1"},
      {"server:\n  shutdown_grace_s: 1e9\n",
       "server.shutdown_grace_s: must be in [0, 86400], got 1e9"},
      {"server:\n  request_threads: 257\n", "server.request_threads: must be in [0, 256], got 257"},
      {"server:\n  request_queue: 0\n", "server.request_queue: must be in [1, 100000], got 0"},
      {"server:\n  metrics_names: prometheus\n",
       "server.metrics_names: must be one of rubato, vllm, both; got 'prometheus'"},
      {"limits:\n  max_queue: 0\n", "limits.max_queue: must be in [1, 1000000], got 0"},
      {"limits:\n  request_timeout_s: 0\n",
       "limits.request_timeout_s: must be in (0, 86400], got 0"},
      {"limits:\n  request_timeout_s: 86400.5\n",
       "limits.request_timeout_s: must be in (0, 86400], got 86400.5"},
      {"limits:\n  rpc_timeout_ms: 0\n", "limits.rpc_timeout_ms: must be in [1, 600000], got 0"},
      {"limits:\n  heartbeat_ms: 600001\n",
       "limits.heartbeat_ms: must be in [1, 600000], got 600001"},
      {"limits:\n  max_prompt_tokens: -5\n",
       "limits.max_prompt_tokens: must be in [0, 16777216], got -5"},
      {"cache:\n  budget_gib: 0\n", "cache.budget_gib: must be in (0, 1048576], got 0"},
      {"cache:\n  budget_gib: 2e6\n", "cache.budget_gib: must be in (0, 1048576], got 2e6"},
      {"cache:\n  budget_gib: 1e-12\n", "cache.budget_gib: 1e-12 GiB is less than a byte"},
      {"cache:\n  device: -2\n", "cache.device: must be in [-1, 1023], got -2"},
  };
  for (const Case& c : cases) EXPECT_THAT(ConfigError(c.yaml), HasSubstr(c.expected)) << c.yaml;
}

TEST(Config, BadEnumValuesListTheChoices) {
  struct Case {
    std::string yaml;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"engine:\n  backend: tpu\n",
       "rubato.yaml: engine.backend: must be one of cpu, cuda; got 'tpu' (line 2)"},
      {"engine:\n  dtype: fp8\n", "engine.dtype: must be one of f32, bf16, f16; got 'fp8'"},
      {"topology:\n  mode: split\n",
       "topology.mode: must be one of colocated, disaggregated; got 'split'"},
      {"topology:\n  transport: tcp\n",
       "topology.transport: must be one of loopback, ucx, nccl; got 'tcp'"},
      {"topology:\n  ranks: [{rank: 0, role: decoder}]\n",
       "topology.ranks[0].role: must be one of inference, cache; got 'decoder'"},
      {"cache:\n  memory: host\n",
       "cache.memory: must be one of pageable, pinned, device; got 'host'"},
      {"logging:\n  level: verbose\n",
       "logging.level: must be one of trace, debug, info, warn, error, off; got 'verbose'"},
  };
  for (const Case& c : cases) EXPECT_THAT(ConfigError(c.yaml), HasSubstr(c.expected)) << c.yaml;
}

TEST(Config, TopologyEntriesAreChecked) {
  EXPECT_THAT(ConfigError("topology:\n  ranks:\n    - {rank: 0, role: inference}\n"
                          "    - {rank: 0, role: cache}\n"),
              HasSubstr("rubato.yaml: topology.ranks[1].rank: rank 0 is already listed in "
                        "topology.ranks[0]"));
  EXPECT_THAT(ConfigError("topology:\n  ranks:\n    - {rank: 2}\n"),
              HasSubstr("topology.ranks[0].role: missing; every entry needs rank and role"));
  EXPECT_THAT(ConfigError("topology:\n  ranks:\n    - {rank: -1, role: cache}\n"),
              HasSubstr("topology.ranks[0].rank: must be in [0, 2147483647], got -1"));
  EXPECT_THAT(ConfigError("topology:\n  cache_endpoints: [\"a:1\", \"cache-0\"]\n"),
              HasSubstr("topology.cache_endpoints[1]: expected host:port with a port in "
                        "[1, 65535], got 'cache-0'"));
  EXPECT_THAT(ConfigError("topology:\n  cache_endpoints: [\"a:70000\"]\n"),
              HasSubstr("topology.cache_endpoints[0]: expected host:port"));
}

TEST(Config, CrossFieldChecksNameBothKeys) {
  EXPECT_THAT(ConfigError("server:\n  cors_allowed_origins: [example.com]\n"),
              HasSubstr("server.cors_allowed_origins[0]: must be \"*\" or an origin"));
  EXPECT_THAT(ConfigError("server:\n  port: 9090\n  metrics_port: 9090\n"),
              HasSubstr("rubato.yaml: server.metrics_port: must differ from server.port (9090)"));
  EXPECT_THAT(ConfigError("engine:\n  max_context: 4096\nlimits:\n  max_prompt_tokens: 5000\n"),
              HasSubstr("rubato.yaml: limits.max_prompt_tokens: 5000 exceeds engine.max_context "
                        "(4096) (line 4)"));
  EXPECT_TRUE(ParseConfig("limits:\n  max_prompt_tokens: 5000\n", "rubato.yaml").ok());
}

TEST(Config, SyntaxErrorsReportLineAndColumn) {
  EXPECT_THAT(ConfigError("engine:\n  max_batch: 4\n  block_size: [16, 64\nserver: {}\n"),
              AllOf(HasSubstr("rubato.yaml: line "), HasSubstr("YAML syntax error")));
  EXPECT_THAT(ConfigError("engine:\n  max_batch: 4\n   device: 0\n"),
              HasSubstr("rubato.yaml: line 3, column 10: YAML syntax error: illegal map value"));
  EXPECT_THAT(ConfigError("engine: {}\n---\nserver: {}\n"),
              HasSubstr("rubato.yaml: expected one YAML document, found 2"));
  EXPECT_THAT(ConfigError("engine:\n  max_batch: 4\n  max_batch: 5\n"),
              HasSubstr("rubato.yaml: engine.max_batch: duplicate key (first given on line 2) "
                        "(line 3)"));
}

// A ',' outside any [] or {} made yaml-cpp's LoadAll return null documents forever: ParseConfig
// allocated until the machine ran out of memory (found by tests/fuzz/yaml_config_fuzzer).
TEST(Config, AStrayCommaIsASyntaxErrorNotAnEndlessStream) {
  EXPECT_THAT(ConfigError(","), HasSubstr("rubato.yaml: line 1, column 1: YAML syntax error: "
                                          "unexpected ','"));
  EXPECT_THAT(ConfigError("[a], b\n"), HasSubstr("line 1, column 4: YAML syntax error"));
  EXPECT_THAT(ConfigError("engine: {}\n---\n# note\n  ,\n"),
              HasSubstr("line 4, column 3: YAML syntax error: unexpected ','"));
}

TEST(Config, LoadConfigFileNamesThePath) {
  TestTempDir dir("config");
  Status missing = LoadConfigFile(dir.path() / "absent.yaml").status();
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("absent.yaml: no such file"));

  const auto path = dir.WriteFile("rubato.yaml", "engine:\n  max_batch: 0\n");
  Status invalid = LoadConfigFile(path).status();
  EXPECT_THAT(invalid.message(),
              HasSubstr(path.string() + ": engine.max_batch: must be in [1, 4096], got 0"));

  dir.WriteFile("ok.yaml", "engine:\n  backend: cuda\n");
  auto config = LoadConfigFile(dir.path() / "ok.yaml");
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->engine.backend, EngineSection::Backend::kCuda);
  EXPECT_EQ(config->engine.max_batch, 8);  // untouched keys keep their defaults
}

TEST(Config, EnumNamesMatchTheYamlSpelling) {
  EXPECT_EQ(ConfigEnumName(EngineSection::Backend::kCuda), "cuda");
  EXPECT_EQ(ConfigEnumName(TopologySection::Mode::kDisaggregated), "disaggregated");
  EXPECT_EQ(ConfigEnumName(TopologySection::Transport::kUcx), "ucx");
  EXPECT_EQ(ConfigEnumName(RankSpec::Role::kCache), "cache");
  EXPECT_EQ(ConfigEnumName(CacheSection::Memory::kPageable), "pageable");
  EXPECT_EQ(ConfigEnumName(CacheSection::Memory::kDevice), "device");
}

TEST(Config, CacheKeysAreNamedAndDefaultToFourGibOfPageableMemory) {
  const CacheSection defaults = DefaultConfig().cache;
  EXPECT_EQ(defaults.budget_bytes(), uint64_t{4} << 30);
  EXPECT_EQ(defaults.memory, CacheSection::Memory::kPageable);
  EXPECT_EQ(defaults.device, -1);
  EXPECT_THAT(ConfigError("cache:\n  budget_mb: 100\n"), HasSubstr("cache.budget_mb"));
  EXPECT_THAT(ConfigError("cache:\n  budget_gib: lots\n"), HasSubstr("cache.budget_gib"));
  auto small = ParseConfig("cache:\n  budget_gib: 0.5\n", "small.yaml");
  ASSERT_TRUE(small.ok()) << small.status().message();
  EXPECT_EQ(small->cache.budget_bytes(), uint64_t{1} << 29);
}

}  // namespace
}  // namespace rubato
