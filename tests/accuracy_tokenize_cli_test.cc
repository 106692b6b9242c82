// `rubato tokenize`, the exact token counter of bench/accuracy/generate.py: its ids and counts
// must equal the in-process tokenizer's for texts with newlines, quotes and non-ASCII, and a
// line that is not a JSON string must end in a one-line error.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/test_temp_dir.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/cli_runner.h"

namespace rubato {
namespace {

const char* const kModel = "models/tiny-qwen3-longctx";

struct ShellResult {
  int exit_status = -1;
  std::string out;
};

// Runs `rubato tokenize ARGS < input_file 2>&1`.
ShellResult RunTokenize(const std::string& args, const std::string& input_file) {
  const std::string command =
      std::string(RUBATO_BINARY) + " tokenize " + args + " < '" + input_file + "' 2>&1";
  ShellResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.out.append(buffer, n);
  result.exit_status = pclose(pipe);
  return result;
}

const std::vector<std::string> kTexts = {
    "The pass key is 48213. Remember it.",
    "line one\nline two\n\n \"quoted\" \\ back\tslash",
    " caf\xC3\xA9 \xE2\x82\xAC 100 \xF0\x9F\x98\x80",
    "",
};

TEST(AccuracyTokenizeCli, IdsAndCountsMatchTheTokenizer) {
  auto tokenizer = Tokenizer::LoadFromDirectory(kModel);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().message();
  TestTempDir dir;
  std::string input;
  for (const std::string& text : kTexts) input += nlohmann::json(text).dump() + "\n";
  const std::string input_file = dir.WriteFile("in.jsonl", input).string();

  const ShellResult ids = RunTokenize(std::string("--model ") + kModel, input_file);
  const ShellResult counts = RunTokenize(std::string("--model ") + kModel + " --count", input_file);
  ASSERT_EQ(ids.exit_status, 0) << ids.out;
  ASSERT_EQ(counts.exit_status, 0) << counts.out;
  const std::vector<std::string> id_lines = testing::NonEmptyLines(ids.out);
  const std::vector<std::string> count_lines = testing::NonEmptyLines(counts.out);
  ASSERT_EQ(id_lines.size(), kTexts.size()) << ids.out;
  ASSERT_EQ(count_lines.size(), kTexts.size()) << counts.out;
  for (size_t i = 0; i < kTexts.size(); ++i) {
    const std::vector<int> expected = (*tokenizer)->Encode(kTexts[i]);
    EXPECT_EQ(nlohmann::json::parse(id_lines[i]).get<std::vector<int>>(), expected) << i;
    EXPECT_EQ(count_lines[i], std::to_string(expected.size())) << i;
  }
}

TEST(AccuracyTokenizeCli, RejectsLinesThatAreNotJsonStrings) {
  auto tokenizer = Tokenizer::LoadFromDirectory(kModel);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().message();
  TestTempDir dir;
  const std::string input_file = dir.WriteFile("in.txt", "\"fine\"\nnot quoted\n").string();
  const ShellResult result = RunTokenize(std::string("--model ") + kModel + " --count", input_file);
  EXPECT_NE(result.exit_status, 0);
  const std::vector<std::string> lines = testing::NonEmptyLines(result.out);
  ASSERT_EQ(lines.size(), 2u) << result.out;
  EXPECT_EQ(lines[0], std::to_string((*tokenizer)->Encode("fine").size()));
  EXPECT_EQ(lines[1],
            "rubato: error: tokenize: stdin line 2 is not a JSON string (write each "
            "text as \"...\" with JSON escapes)");
}

TEST(AccuracyTokenizeCli, MissingModelIsOneLineError) {
  TestTempDir dir;
  const std::string input_file = dir.WriteFile("in.txt", "\"x\"\n").string();
  const ShellResult result = RunTokenize("--model /nonexistent/model", input_file);
  EXPECT_NE(result.exit_status, 0);
  EXPECT_EQ(result.out, "rubato: error: model directory '/nonexistent/model' does not exist\n");
}

}  // namespace
}  // namespace rubato
