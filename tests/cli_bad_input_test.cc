// Bad input through the `rubato generate` command: each case must end with exactly one line on
// stderr naming the problem and a non-zero exit, never a crash or a hang (docs/design.md §7
// "Bad input and faults").
// Each case copies the bundled tiny model into a temporary directory and breaks one thing.
// Also: the backend switch (`--backend cuda` without CUDA in the build or without a GPU), and
// prompts given as token ids for a model directory holding only config.json (--random-weights).
#include <gtest/gtest.h>

#ifdef RUBATO_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/text_file.h"
#include "tests/cli_model_test_fixture.h"

namespace rubato {
namespace {

namespace fs = std::filesystem;
using testing::NonEmptyLines;
using testing::ProcessResult;
using testing::RunProcess;

// The bytes of `path`, or "" when it cannot be read (the test then fails on the content).
std::string ReadFile(const fs::path& path) {
  Result<std::string> bytes = ReadTextFile(path);
  EXPECT_TRUE(bytes.ok()) << bytes.status().message();
  return bytes.ok() ? *bytes : std::string();
}

void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file split into its JSON header and its data section, editable and
// re-serialisable (data offsets are relative to the data section, so edits to the header
// keep them valid).
struct SafetensorsParts {
  nlohmann::json header;
  std::string data;

  static SafetensorsParts Read(const fs::path& path) {
    const std::string bytes = ReadFile(path);
    uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);
    SafetensorsParts parts;
    parts.header = nlohmann::json::parse(bytes.substr(8, header_len));
    parts.data = bytes.substr(8 + header_len);
    return parts;
  }

  void Write(const fs::path& path) const {
    std::string text = header.dump();
    while (text.size() % 8 != 0) text += ' ';
    const uint64_t header_len = text.size();
    std::string bytes(8, '\0');
    std::memcpy(bytes.data(), &header_len, 8);
    WriteFile(path, bytes + text + data);
  }
};

class CliBadInputTest : public testing::CliModelTest {
 protected:
  fs::path Weights() const { return model_ / "model.safetensors"; }

  void EditConfig(const std::string& key, const nlohmann::json& value) {
    nlohmann::json config = nlohmann::json::parse(ReadFile(model_ / "config.json"));
    config[key] = value;
    WriteFile(model_ / "config.json", config.dump(2));
  }

  fs::path WriteYaml(const std::string& text) {
    const fs::path path = dir_.path() / "rubato.yaml";
    WriteFile(path, text);
    return path;
  }
};

TEST_F(CliBadInputTest, BaselineSucceeds) {
  const ProcessResult r = Generate({});
  ASSERT_FALSE(r.signaled);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("prompt_tokens="), std::string::npos) << r.out;
}

TEST_F(CliBadInputTest, TruncatedSafetensors) {
  const std::string bytes = ReadFile(Weights());
  WriteFile(Weights(), bytes.substr(0, bytes.size() / 2));
  ExpectCleanFailure(Generate({}), {"model.safetensors"});
}

TEST_F(CliBadInputTest, TruncatedSafetensorsHeaderLength) {
  WriteFile(Weights(), std::string("\x10\x00\x00", 3));
  ExpectCleanFailure(Generate({}), {"model.safetensors"});
}

TEST_F(CliBadInputTest, HeaderClaimsBytesPastTheEnd) {
  SafetensorsParts parts = SafetensorsParts::Read(Weights());
  auto& entry = parts.header["model.norm.weight"];
  const uint64_t size =
      entry["data_offsets"][1].get<uint64_t>() - entry["data_offsets"][0].get<uint64_t>();
  const uint64_t begin = parts.data.size() - size / 2;
  entry["data_offsets"] = {begin, begin + size};
  parts.Write(Weights());
  ExpectCleanFailure(Generate({}), {"model.safetensors", "model.norm.weight"});
}

TEST_F(CliBadInputTest, OverlappingTensors) {
  SafetensorsParts parts = SafetensorsParts::Read(Weights());
  // Both are [hidden] bf16: give the final norm the byte range of layer 0's input norm.
  parts.header["model.norm.weight"]["data_offsets"] =
      parts.header["model.layers.0.input_layernorm.weight"]["data_offsets"];
  parts.Write(Weights());
  ExpectCleanFailure(Generate({}), {"model.safetensors", "overlap"});
}

TEST_F(CliBadInputTest, UnknownDtype) {
  SafetensorsParts parts = SafetensorsParts::Read(Weights());
  parts.header["model.norm.weight"]["dtype"] = "Q7";
  parts.Write(Weights());
  ExpectCleanFailure(Generate({}), {"model.safetensors", "Q7"});
}

TEST_F(CliBadInputTest, MissingTensor) {
  SafetensorsParts parts = SafetensorsParts::Read(Weights());
  parts.header.erase("model.layers.2.mlp.up_proj.weight");
  parts.Write(Weights());
  ExpectCleanFailure(Generate({}), {"model.layers.2.mlp.up_proj.weight"});
}

TEST_F(CliBadInputTest, ShapeDisagreesWithConfig) {
  EditConfig("intermediate_size", 320);  // the checkpoint's MLP is 384 wide
  ExpectCleanFailure(Generate({}), {"shape", "mlp"});
}

TEST_F(CliBadInputTest, HeadsNotDivisibleByKvHeads) {
  EditConfig("num_key_value_heads", 3);  // 8 query heads
  ExpectCleanFailure(Generate({}), {"config.json", "num_key_value_heads"});
}

TEST_F(CliBadInputTest, UnsupportedArchitecture) {
  EditConfig("architectures", nlohmann::json::array({"MistralForCausalLM"}));
  ExpectCleanFailure(Generate({}), {"MistralForCausalLM"});
}

TEST_F(CliBadInputTest, MalformedTokenizerJson) {
  WriteFile(model_ / "tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": [");
  ExpectCleanFailure(Generate({}), {"tokenizer.json"});
}

TEST_F(CliBadInputTest, MissingModelDirectory) {
  fs::remove_all(model_);
  ExpectCleanFailure(Generate({}), {model_.string()});
}

TEST_F(CliBadInputTest, YamlUnknownKey) {
  const fs::path yaml = WriteYaml("engine:\n  blocksize: 16\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"rubato.yaml", "engine.blocksize"});
}

TEST_F(CliBadInputTest, YamlWrongType) {
  const fs::path yaml = WriteYaml("server:\n  port: abc\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"rubato.yaml", "server.port"});
}

TEST_F(CliBadInputTest, YamlOutOfRange) {
  const fs::path yaml = WriteYaml("engine:\n  max_batch: 0\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"rubato.yaml", "engine.max_batch"});
}

TEST_F(CliBadInputTest, YamlSyntaxError) {
  const fs::path yaml = WriteYaml("engine: [max_batch: 1\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"rubato.yaml"});
}

bool GpuPresent();

// The config's cache section: bad keys and values are refused by key path, by `generate` and by
// `rubato cache`; the colocated cache rank enforces the budget it sets.
TEST_F(CliBadInputTest, CacheSectionKeysAreRefusedByName) {
  fs::path yaml = WriteYaml("cache:\n  memory: host\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"rubato.yaml", "cache.memory"});
  yaml = WriteYaml("cache:\n  budget_gib: 0\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"rubato.yaml", "cache.budget_gib"});
  yaml = WriteYaml("cache:\n  budget: 1\n");
  ExpectCleanFailure(RunProcess(RUBATO_BINARY, {"cache", "--config", yaml.string()}),
                     {"rubato.yaml", "cache.budget"});
  yaml = WriteYaml("cache:\n  memory: device\n");
  // A GPU cache rank of its own process needs a GPU (and a CUDA build with NCCL).
  if (!GpuPresent()) {
    ExpectCleanFailure(RunProcess(RUBATO_BINARY, {"cache", "--config", yaml.string()}),
                       {"cache.memory 'device'"});
  }
  // A GPU cache rank in the inference rank's process needs the CUDA model, and runs attention
  // there: a policy that selects rows on the cache rank is refused by name.
  ExpectCleanFailure(Generate({"--config", yaml.string(), "--kv-residency", "offloaded"}),
                     {"cache.memory: device"});
  ExpectCleanFailure(Generate({"--config", yaml.string(), "--kv-residency", "offloaded", "--policy",
                               "oracle_topk"}),
                     {"cache.memory: device", "oracle_topk"});
}

TEST_F(CliBadInputTest, TheColocatedCacheRankEnforcesTheConfigsBudget) {
  // 4 KiB (2^-18 GiB): less than one session of the tiny model, which reserves 2 KiB a token
  // (4 layers x 2 KV heads x head_dim 32 x 4 bytes x K and V) for its prompt and 2 new tokens.
  // (The engine's warning about the refused session is logged at warn: keep it off stderr.)
  const fs::path yaml =
      WriteYaml("cache:\n  budget_gib: 3.814697265625e-06\nlogging:\n  level: error\n");
  ExpectCleanFailure(Generate({"--config", yaml.string(), "--kv-residency", "offloaded"}),
                     {"budget's 4096 bytes"});
  // With the default budget the same run succeeds, and its stats line reports the exchange per
  // step and the cache rank's selection time and memory.
  const ProcessResult fits = Generate({"--kv-residency", "offloaded"});
  EXPECT_EQ(fits.exit_code, 0) << fits.err;
  const auto number = [&](const std::string& key) {
    const size_t at = fits.out.find(" " + key + "=");
    EXPECT_NE(at, std::string::npos) << key << " missing: " << fits.out;
    return at == std::string::npos ? -1.0 : std::stod(fits.out.substr(at + key.size() + 2));
  };
  EXPECT_GT(number("offload_steps"), 0);
  EXPECT_GT(number("step_bytes_sent"), 0);
  EXPECT_GT(number("step_bytes_received"), 0);
  EXPECT_GE(number("step_wait_ms"), 0);
  EXPECT_GE(number("cache_selection_ms"), 0);
  EXPECT_GT(number("cache_memory_peak_bytes"), 0);
  EXPECT_NE(fits.out.find(" cache_memory=host"), std::string::npos) << fits.out;
}

TEST_F(CliBadInputTest, MissingConfigFile) {
  ExpectCleanFailure(Generate({"--config", (dir_.path() / "absent.yaml").string()}),
                     {"absent.yaml"});
}

TEST_F(CliBadInputTest, UnknownPolicyFlag) {
  ExpectCleanFailure(Generate({"--policy", "sfi2"}), {"unknown policy 'sfi2'", "dense"});
}

// A policy on a KV residency it does not support is refused by name from its traits, before
// anything loads (the model directory does not even exist here).
TEST_F(CliBadInputTest, UnsupportedPolicyResidencyPairIsRefusedByName) {
  for (const std::string policy : {"sfi", "streaming_llm"}) {
    ExpectCleanFailure(
        RunProcess(RUBATO_BINARY,
                   {"generate", "--model", (dir_.path() / "absent").string(), "--prompt", "hello",
                    "--policy", policy, "--kv-residency", "offloaded"}),
        {"policy '" + policy + "' does not support offloaded KV (supported: local)"});
  }
  ExpectCleanFailure(Generate({"--kv-residency", "evicting"}),
                     {"policy 'dense' does not support evicting KV (supported: local, "
                      "offloaded)"});
  ExpectCleanFailure(Generate({"--policy", "longflow", "--kv-residency", "local"}),
                     {"policy 'longflow' does not support local KV (supported: evicting)"});
  // The old spelling of dense on offloaded KV with local KV asked for: refused, not run offloaded.
  ExpectCleanFailure(Generate({"--policy", "offload_dense", "--kv-residency", "local"}),
                     {"--policy offload_dense is --policy dense on offloaded KV; it conflicts "
                      "with --kv-residency local"});
  ExpectCleanFailure(Generate({"--kv-residency", "split"}),
                     {"--kv-residency: 'split' is not one of auto, local, offloaded, evicting, "
                      "split_by_head"});
  ExpectCleanFailure(Generate({"--kv-residency", "split_by_head"}),
                     {"policy 'dense' does not support split_by_head KV (supported: local, "
                      "offloaded)"});
}

// `rubato serve` names its model: the default model.path has random weights.
TEST_F(CliBadInputTest, ServeWithoutAModelIsRefused) {
  ExpectCleanFailure(RunProcess(RUBATO_BINARY, {"serve", "--port", "0"}),
                     {"no model to serve: pass --model DIR"});
}

TEST_F(CliBadInputTest, UnknownPolicyInYaml) {
  const fs::path yaml = WriteYaml("policy:\n  name: quest9\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"unknown policy 'quest9'"});
}

// sfi's parameters are validated before anything loads.
TEST_F(CliBadInputTest, SfiPolicyParametersAreValidated) {
  const fs::path bad = WriteYaml("policy:\n  name: sfi\n  t_max: 0\n");
  ExpectCleanFailure(Generate({"--config", bad.string()}), {"policy.t_max"});
  const fs::path trigger =
      WriteYaml("policy:\n  name: sfi\n  triggers: [\"\\u00e9\\u00e9\\u00e9zz\"]\n");
  ExpectCleanFailure(Generate({"--config", trigger.string()}), {"trigger"});
}

// And a valid sfi config runs (CPU backend) and reports its step kinds on the stats line.
TEST_F(CliBadInputTest, SfiPolicyGeneratesAndReportsItsSteps) {
  const fs::path yaml = WriteYaml(
      "policy:\n  name: sfi\n  sink_tokens: 1\n  recent_window: 2\n  budget: 2\n"
      "  t_max: 2\n  triggers: []\n");
  const ProcessResult r =
      RunProcess(RUBATO_BINARY, {"generate", "--model", model_.string(), "--prompt", "hello",
                                 "--max-tokens", "6", "--config", yaml.string()});
  ASSERT_FALSE(r.signaled) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("policy=sfi"), std::string::npos) << r.out;
  // 6 tokens: the prompt's selection, then decode steps slow, fast, fast, slow, fast.
  EXPECT_NE(r.out.find("sfi_slow_steps=3 sfi_fast_steps=3 sfi_discarded_steps=0"),
            std::string::npos)
      << r.out;
}

TEST_F(CliBadInputTest, UnknownPolicyParameter) {
  const fs::path yaml = WriteYaml("policy:\n  name: dense\n  budget: 10\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"policy.budget"});
}

TEST_F(CliBadInputTest, PromptLongerThanModelContext) {
  // The model's max_position_embeddings is 4096; this prompt is several thousand tokens.
  std::string prompt;
  for (int i = 0; i < 3000; ++i) prompt += "lighthouse keeper " + std::to_string(i) + ". ";
  std::vector<std::string> args = {"generate",     "--model", model_.string(), "--prompt", prompt,
                                   "--max-tokens", "2"};
  ExpectCleanFailure(RunProcess(RUBATO_BINARY, args), {"prompt has", "context"});
}

TEST_F(CliBadInputTest, PromptLongerThanConfiguredContext) {
  const fs::path yaml = WriteYaml("engine:\n  max_context: 16\n");
  std::vector<std::string> args = {
      "generate",
      "--model",
      model_.string(),
      "--config",
      yaml.string(),
      "--prompt",
      "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
      "--max-tokens",
      "2"};
  ExpectCleanFailure(RunProcess(RUBATO_BINARY, args), {"prompt has", "16"});
}

// `--backend cuda` (and engine.backend: cuda) where it cannot run: a build without CUDA names
// the configure flag; a CUDA build on a machine without a GPU reports the CUDA error. On a GPU
// machine the CUDA model runs, so there is no failure to check.
void ExpectCudaUnavailable(const ProcessResult& r) {
  ASSERT_FALSE(r.signaled) << "rubato was killed by signal " << r.signal << "\n" << r.err;
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const std::vector<std::string> lines = NonEmptyLines(r.err);
  ASSERT_EQ(lines.size(), 1u) << "expected one line on stderr, got:\n" << r.err;
  EXPECT_EQ(lines[0].rfind("rubato: error: ", 0), 0u) << lines[0];
#ifdef RUBATO_HAS_CUDA
  EXPECT_NE(lines[0].find("CUDA"), std::string::npos) << lines[0];
#else
  EXPECT_NE(lines[0].find("engine.backend 'cuda': this rubato was built without CUDA "
                          "(configure with -DRUBATO_CUDA=ON)"),
            std::string::npos)
      << lines[0];
#endif
}

bool GpuPresent() {
#ifdef RUBATO_HAS_CUDA
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

TEST_F(CliBadInputTest, CudaBackendFlagWithoutCudaOrGpu) {
  if (GpuPresent()) GTEST_SKIP() << "a GPU is present: --backend cuda runs";
  ExpectCudaUnavailable(Generate({"--backend", "cuda"}));
}

TEST_F(CliBadInputTest, CudaBackendInYamlWithoutCudaOrGpu) {
  if (GpuPresent()) GTEST_SKIP() << "a GPU is present: engine.backend cuda runs";
  const fs::path yaml = WriteYaml("engine:\n  backend: cuda\n");
  ExpectCudaUnavailable(Generate({"--config", yaml.string()}));
}

TEST_F(CliBadInputTest, UnknownBackendFlag) {
  const ProcessResult r = Generate({"--backend", "tpu"});
  ASSERT_FALSE(r.signaled);
  EXPECT_EQ(r.exit_code, 2);  // a command-line syntax error
  EXPECT_NE(r.err.find("--backend"), std::string::npos) << r.err;
}

TEST_F(CliBadInputTest, PromptIdsWithConfigOnlyAndRandomWeights) {
  // A directory with config.json alone: no tokenizer, no checkpoint.
  const fs::path config_only = dir_.path() / "config_only";
  fs::create_directories(config_only);
  fs::copy_file(model_ / "config.json", config_only / "config.json");
  const std::vector<std::string> args = {
      "generate",    "--model",          config_only.string(), "--prompt-ids",
      "5, 17,300,9", "--random-weights", "--max-tokens",       "3"};
  const ProcessResult r = RunProcess(RUBATO_BINARY, args);
  ASSERT_FALSE(r.signaled) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("prompt_tokens=4 generated_tokens="), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("backend=cpu"), std::string::npos) << r.out;
  // Without a tokenizer the generated tokens are printed as ids: the first line is numbers.
  const std::string first_line = r.out.substr(0, r.out.find('\n'));
  EXPECT_FALSE(first_line.empty()) << r.out;
  EXPECT_EQ(first_line.find_first_not_of("0123456789 "), std::string::npos) << r.out;

  // Without --random-weights the missing checkpoint is the error; a text prompt needs the
  // tokenizer.
  ExpectCleanFailure(RunProcess(RUBATO_BINARY, {"generate", "--model", config_only.string(),
                                                "--prompt-ids", "1,2", "--max-tokens", "1"}),
                     {config_only.string()});
  ExpectCleanFailure(RunProcess(RUBATO_BINARY, {"generate", "--model", config_only.string(),
                                                "--prompt", "hello", "--random-weights"}),
                     {"tokenizer.json"});
}

TEST_F(CliBadInputTest, BadPromptIds) {
  const ProcessResult r =
      RunProcess(RUBATO_BINARY, {"generate", "--model", model_.string(), "--prompt-ids", "1,x,3"});
  ExpectCleanFailure(r, {"--prompt-ids", "'x'"});
  // 5000 is outside the tiny model's 1024-token vocabulary.
  ExpectCleanFailure(
      RunProcess(RUBATO_BINARY, {"generate", "--model", model_.string(), "--prompt-ids", "1,5000"}),
      {"5000", "vocabulary"});
  ExpectCleanFailure(RunProcess(RUBATO_BINARY, {"generate", "--model", model_.string(),
                                                "--prompt-ids", "1,2", "--chat"}),
                     {"--chat"});
}

TEST_F(CliBadInputTest, PromptRequiredAndExclusive) {
  ProcessResult none = RunProcess(RUBATO_BINARY, {"generate", "--model", model_.string()});
  ASSERT_FALSE(none.signaled);
  EXPECT_EQ(none.exit_code, 2);
  ASSERT_EQ(NonEmptyLines(none.err).size(), 1u) << none.err;
  EXPECT_NE(none.err.find("--prompt"), std::string::npos) << none.err;
  ProcessResult both = RunProcess(RUBATO_BINARY, {"generate", "--model", model_.string(),
                                                  "--prompt", "hi", "--prompt-ids", "1"});
  ASSERT_FALSE(both.signaled);
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_NE(both.err.find("--prompt"), std::string::npos) << both.err;
}

TEST_F(CliBadInputTest, BadSamplingFlags) {
  ExpectCleanFailure(Generate({"--top-p", "1.5"}), {"top-p"});
  ExpectCleanFailure(Generate({"--temperature", "-1"}), {"temperature"});
}

}  // namespace
}  // namespace rubato
