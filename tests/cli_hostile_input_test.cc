// Hostile input through the `rubato generate` command: JSON and YAML nested far past any real
// file (config.json, tokenizer.json, a safetensors header, the YAML config), endless or special
// files where a file is expected (/dev/zero, a FIFO, a symlink loop), a very long path, and model
// sizes far past any real model. Each must end at once with exactly one short stderr line naming
// the problem and a non-zero exit: never a crash (a stack overflow), a hang or a runaway
// allocation. docs/security.md "Bounded input".
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/text_file.h"
#include "tests/cli_model_test_fixture.h"

namespace rubato {
namespace {

namespace fs = std::filesystem;
constexpr int kDeep = 100000;  // levels: ~200 KB of brackets

std::string Deep() { return std::string(kDeep, '[') + std::string(kDeep, ']'); }

std::string Read(const fs::path& path) {
  Result<std::string> bytes = ReadTextFile(path);
  EXPECT_TRUE(bytes.ok()) << bytes.status().message();
  return bytes.ok() ? *bytes : std::string();
}

void Write(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// `{"deep": [[[...]]], <the rest of the object>`: valid JSON, nested kDeep levels.
std::string WithDeepField(const std::string& json_object) {
  const size_t brace = json_object.find('{');
  EXPECT_NE(brace, std::string::npos);
  return json_object.substr(0, brace + 1) + "\"deep\": " + Deep() + ", " +
         json_object.substr(brace + 1);
}

class CliHostileInputTest : public testing::CliModelTest {};

TEST_F(CliHostileInputTest, DeepModelConfigJson) {
  Write(model_ / "config.json", WithDeepField(Read(model_ / "config.json")));
  ExpectCleanFailure(Generate({}), {"config.json", "nested deeper than"});
}

TEST_F(CliHostileInputTest, DeepTokenizerJson) {
  Write(model_ / "tokenizer.json", WithDeepField(Read(model_ / "tokenizer.json")));
  ExpectCleanFailure(Generate({}), {"tokenizer.json", "nested deeper than"});
}

TEST_F(CliHostileInputTest, DeepSafetensorsHeader) {
  const std::string bytes = Read(model_ / "model.safetensors");
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  std::string header = bytes.substr(8, header_len);
  const size_t dtype = header.find("\"dtype\"");
  ASSERT_NE(dtype, std::string::npos);
  const size_t value = header.find(':', dtype) + 1;
  const size_t value_end = header.find(',', value);
  header = header.substr(0, value) + Deep() + header.substr(value_end);
  while (header.size() % 8 != 0) header += ' ';
  std::string out(8, '\0');
  const uint64_t new_len = header.size();
  std::memcpy(out.data(), &new_len, 8);
  Write(model_ / "model.safetensors", out + header + bytes.substr(8 + header_len));
  ExpectCleanFailure(Generate({}), {"model.safetensors", "nested deeper than"});
}

TEST_F(CliHostileInputTest, DeepYamlConfig) {
  const fs::path yaml = dir_.path() / "rubato.yaml";
  Write(yaml, "policy: " + std::string(kDeep, '[') + "\n");
  ExpectCleanFailure(Generate({"--config", yaml.string()}), {"rubato.yaml", "nested deeper than"});
}

TEST_F(CliHostileInputTest, EndlessAndSpecialFilesAreRefusedAtOnce) {
  ExpectCleanFailure(Generate({"--config", "/dev/zero"}), {"/dev/zero", "character device"});
  fs::remove(model_ / "config.json");
  fs::create_symlink("/dev/zero", model_ / "config.json");
  ExpectCleanFailure(Generate({}), {"config.json", "character device"});
  const fs::path fifo = dir_.path() / "fifo.yaml";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ExpectCleanFailure(Generate({"--config", fifo.string()}), {"fifo.yaml", "FIFO"});
  const fs::path loop = dir_.path() / "loop.yaml";
  fs::create_symlink(loop, loop);
  ExpectCleanFailure(Generate({"--config", loop.string()}), {"loop.yaml"});
}

TEST_F(CliHostileInputTest, VeryLongPathIsNamedBriefly) {
  const std::string path = "/" + std::string(100000, 'p') + ".yaml";
  ExpectCleanFailure(Generate({"--config", path}), {"characters"});
}

TEST_F(CliHostileInputTest, ModelSizesFarPastAnyModelAreRefusedBeforeAllocation) {
  const std::string config = Read(model_ / "config.json");
  auto with = [&](const std::string& key, const std::string& value) {
    const size_t at = config.find("\"" + key + "\"");
    EXPECT_NE(at, std::string::npos) << key;
    const size_t start = config.find(':', at) + 1;
    const size_t end = config.find_first_of(",}", start);
    Write(model_ / "config.json", config.substr(0, start) + " " + value + config.substr(end));
  };
  with("num_hidden_layers", "1000000000");
  ExpectCleanFailure(Generate({}), {"num_hidden_layers", "at most"});
  with("max_position_embeddings", "2147483647");
  ExpectCleanFailure(Generate({}), {"max_position_embeddings", "at most"});
  with("vocab_size", "2000000000");
  ExpectCleanFailure(Generate({}), {"vocab_size", "at most"});
}

TEST_F(CliHostileInputTest, SamplingFlagsOutsideTheirTypes) {
  ExpectCleanFailure(Generate({"--seed", "-1"}), {"--seed", "18446744073709551615"});
  ExpectCleanFailure(Generate({"--seed", "18446744073709551616"}), {"--seed"});
  ExpectCleanFailure(Generate({"--seed", "12abc"}), {"--seed"});
  ExpectCleanFailure(Generate({"--top-k", "-1"}), {"--top-k", "1073741824"});
}

TEST_F(CliHostileInputTest, EosTokenOutsideTheVocabulary) {
  const std::string config = Read(model_ / "config.json");
  const size_t at = config.find("\"eos_token_id\"");
  ASSERT_NE(at, std::string::npos);
  const size_t start = config.find(':', at) + 1;
  const size_t end = config.find_first_of(",}", start);
  Write(model_ / "config.json", config.substr(0, start) + " 99999999" + config.substr(end));
  ExpectCleanFailure(Generate({}), {"eos_token_id", "outside the vocabulary"});
}

// `rubato calibrate kascade` with an endless or special dev set (never read: a FIFO blocked
// forever, /dev/zero took 3 GB in 7 s), an empty --out (exited 0 writing nothing) and a top-k
// past any prompt (3 GB for a 70-token prompt).
TEST_F(CliHostileInputTest, CalibrateRefusesHostileDevSetsAndOptions) {
  const fs::path dev = dir_.path() / "dev.jsonl";
  Write(dev, "{\"prompt\": \"hello\"}\n");
  auto calibrate = [&](const std::string& dev_set, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"calibrate",     "kascade",   "--model",
                                     model_.string(), "--dev-set", dev_set};
    args.insert(args.end(), extra.begin(), extra.end());
    return testing::RunProcess(RUBATO_BINARY, args);
  };
  const std::string out = (dir_.path() / "out.json").string();
  ExpectCleanFailure(calibrate("/dev/zero", {"--out", out}), {"--dev-set", "character device"});
  const fs::path fifo = dir_.path() / "dev.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ExpectCleanFailure(calibrate(fifo.string(), {"--out", out}), {"--dev-set", "FIFO"});
  ExpectCleanFailure(calibrate(dev.string(), {"--out", ""}), {"--out: empty"});
  ExpectCleanFailure(calibrate(dev.string(), {"--out", out, "--top-k", "1048576"}),
                     {"--top-k 1048576 exceeds --max-tokens"});
  EXPECT_FALSE(fs::exists(out));
}

// A calibration file whose number is past a double was an escaped exception ("internal
// error"); now a refusal naming the file.
TEST_F(CliHostileInputTest, CalibrationNumberPastADoubleIsARefusal) {
  std::string calibration = Read("configs/kascade/tiny-qwen3-longctx.json");
  const size_t at = calibration.find("\"top_k\"");
  ASSERT_NE(at, std::string::npos);
  const size_t start = calibration.find(':', at) + 1;
  calibration = calibration.substr(0, start) + " 1e999" +
                calibration.substr(calibration.find_first_of(",}", start));
  const fs::path file = dir_.path() / "cal.json";
  Write(file, calibration);
  const fs::path yaml = dir_.path() / "kascade.yaml";
  Write(yaml, "policy:\n  name: kascade\n  calibration: " + file.string() + "\n");
  const testing::ProcessResult r = Generate({"--config", yaml.string()});
  ExpectCleanFailure(r, {"cal.json", "a value JSON numbers cannot hold"});
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
}

// Policy parameters past the context: LongFlow's budget of 10^8 touched 4.75 GB before its
// refusal, SFI's budget of 2^31 - 1 overflowed into "internal error". Refused by key at once.
TEST_F(CliHostileInputTest, PolicyBudgetsPastTheContextAreRefusedByKey) {
  const fs::path longflow = dir_.path() / "longflow.yaml";
  Write(longflow, "policy:\n  name: longflow\n  budget: 100000000\n");
  ExpectCleanFailure(Generate({"--config", longflow.string(), "--kv-residency", "evicting"}),
                     {"policy.budget: 100000000 tokens exceeds engine.max_context"});
  const fs::path sfi = dir_.path() / "sfi.yaml";
  Write(sfi, "policy:\n  name: sfi\n  budget: 2147483647\n");
  const testing::ProcessResult r = Generate({"--config", sfi.string()});
  ExpectCleanFailure(r, {"policy.budget: 2147483647 tokens exceeds engine.max_context"});
}

// An old policy spelling fixes offloaded KV: `--policy offload_dense --kv-residency local` ran
// offloaded without a word. Now a conflict named by both flags.
TEST_F(CliHostileInputTest, ConflictingPolicyAndResidencyFlagsAreRefused) {
  ExpectCleanFailure(Generate({"--policy", "offload_dense", "--kv-residency", "local"}),
                     {"--policy offload_dense", "conflicts with --kv-residency local"});
  ExpectCleanFailure(Generate({"--policy", "offload_topk", "--kv-residency", "evicting"}),
                     {"--policy offload_topk", "conflicts with --kv-residency evicting"});
}

// JSON files cost ~20x their size once parsed (a 200 MB tokenizer.json took 4.5 GB): each kind
// has its own limit, checked from the file's size before a byte is read (a sparse 1 GiB file).
TEST_F(CliHostileInputTest, OversizedTokenizerJsonIsRefusedFromItsSize) {
  fs::resize_file(model_ / "tokenizer.json", uintmax_t{1} << 30);
  ExpectCleanFailure(Generate({}), {"tokenizer.json", "more than 67108864 bytes"});
}

// A model path of 500 KB in the config is named briefly.
TEST_F(CliHostileInputTest, HugeModelPathIsNotEchoedWhole) {
  const fs::path yaml = dir_.path() / "path.yaml";
  Write(yaml, "model:\n  path: /" + std::string(500000, 'm') + "\n");
  ExpectCleanFailure(testing::RunProcess(RUBATO_BINARY, {"generate", "--config", yaml.string(),
                                                         "--prompt", "hi", "--max-tokens", "1"}),
                     {"model directory", "characters"});
}

}  // namespace
}  // namespace rubato
