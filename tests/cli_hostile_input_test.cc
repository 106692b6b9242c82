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

}  // namespace
}  // namespace rubato
