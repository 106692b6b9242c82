// Bounded input helpers: the JSON and YAML nesting scans (strings, escapes, quotes and comments
// do not count; the level past the limit is refused with its byte offset), message excerpts, and
// whole-file reads (regular files only, a size limit, /dev/zero and FIFOs refused at once,
// symlink loops and very long paths named briefly), and a YAML section of tens of thousands of
// keys read in linear time.
#include "common/json_limits.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "common/config.h"
#include "common/test_temp_dir.h"
#include "common/text_file.h"

namespace rubato {
namespace {

std::string Nested(int depth, char open, char close) {
  return std::string(depth, open) + std::string(depth, close);
}

TEST(JsonNesting, AcceptsUpToTheLimitAndRefusesPastIt) {
  EXPECT_TRUE(CheckJsonNesting(Nested(64, '[', ']'), "x").ok());
  const Status deep = CheckJsonNesting(Nested(65, '[', ']'), "body");
  EXPECT_EQ(deep.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(deep.message(), "body: JSON nested deeper than 64 levels (at byte 64)");
  EXPECT_FALSE(CheckJsonNesting(std::string(100000, '{'), "x").ok());
  EXPECT_TRUE(CheckJsonNesting(Nested(3, '{', '}'), "x", 3).ok());
  EXPECT_FALSE(CheckJsonNesting("[{\"a\": [1]}]", "x", 2).ok());
}

TEST(JsonNesting, BracketsInStringsDoNotCount) {
  const std::string in_string = "{\"k\": \"" + std::string(1000, '[') + "\\\"[[[\"}";
  EXPECT_TRUE(CheckJsonNesting(in_string, "x").ok());
  // An escaped backslash ends the escape: the quote after it closes the string.
  EXPECT_FALSE(CheckJsonNesting("[\"\\\\\"" + std::string(100, '['), "x").ok());
}

TEST(YamlNesting, FlowCollectionsCountQuotesAndCommentsDoNot) {
  EXPECT_TRUE(CheckYamlFlowNesting("a: " + Nested(64, '[', ']'), "c.yaml").ok());
  const Status deep = CheckYamlFlowNesting("a: " + std::string(70, '{'), "c.yaml");
  EXPECT_EQ(deep.message(), "c.yaml: YAML nested deeper than 64 levels (at byte 67)");
  EXPECT_TRUE(CheckYamlFlowNesting("a: '" + std::string(100, '[') + "'", "x").ok());
  EXPECT_TRUE(CheckYamlFlowNesting("a: \"" + std::string(100, '[') + "\"", "x").ok());
  EXPECT_TRUE(CheckYamlFlowNesting("a: 1 # " + std::string(100, '[') + "\nb: 2", "x").ok());
  EXPECT_TRUE(CheckYamlFlowNesting("# " + std::string(100, '{'), "x").ok());
  EXPECT_FALSE(CheckYamlFlowNesting("a: b#" + std::string(100, '['), "x").ok());  // not a comment
}

TEST(Excerpt, ShortTextWholeLongTextCut) {
  EXPECT_EQ(Excerpt("abc"), "abc");
  EXPECT_EQ(Excerpt(std::string(100, 'x'), 4), "xxxx... (100 bytes)");
}

TEST(ReadTextFile, RegularFilesWithinTheLimit) {
  TestTempDir dir("text_file");
  ASSERT_FALSE(dir.path().empty());
  const auto file = dir.WriteFile("a.json", "0123456789");
  auto whole = ReadTextFile(file, 10);
  ASSERT_TRUE(whole.ok()) << whole.status().message();
  EXPECT_EQ(*whole, "0123456789");
  const Result<std::string> over = ReadTextFile(file, 9);
  EXPECT_EQ(over.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(over.status().message().find("more than 9 bytes"), std::string::npos);
  EXPECT_EQ(ReadTextFile(dir.path() / "missing").status().code(), StatusCode::kNotFound);
  const Result<std::string> directory = ReadTextFile(dir.path());
  EXPECT_NE(directory.status().message().find("is a directory"), std::string::npos);
}

TEST(ReadTextFile, DevicesFifosLoopsAndLongPathsAreRefusedBriefly) {
  const Result<std::string> zero = ReadTextFile("/dev/zero");
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("character device"), std::string::npos);
  TestTempDir dir("text_file");
  ASSERT_FALSE(dir.path().empty());
  const auto fifo = dir.path() / "fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(ReadTextFile(fifo).status().message().find("FIFO"), std::string::npos);
  const auto loop = dir.path() / "loop";
  ASSERT_EQ(symlink(loop.c_str(), loop.c_str()), 0);
  const Result<std::string> looped = ReadTextFile(loop);
  EXPECT_EQ(looped.status().code(), StatusCode::kIoError) << looped.status().message();
  const std::string long_path = "/" + std::string(5 << 20, 'a');
  const Result<std::string> long_read = ReadTextFile(long_path);
  EXPECT_FALSE(long_read.ok());
  EXPECT_LT(long_read.status().message().size(), 400u);
  EXPECT_NE(long_read.status().message().find("characters"), std::string::npos);
}

// 30k keys in the policy section: parsed, handed to the policy as parameters and refused as
// unknown keys. With linear searches per key this took minutes (20k keys: 19 s without
// sanitizers); linear, well under a second. The bound holds on a loaded 2-core machine under
// ASan many times over.
TEST(YamlConfig, ManyKeysAreReadInLinearTime) {
  std::string yaml = "policy:\n  name: dense\n";
  for (int i = 0; i < 30000; ++i)
    yaml += "  k" + std::to_string(i) + ": " + std::to_string(i) + "\n";
  const auto start = std::chrono::steady_clock::now();
  Result<RubatoConfig> config = ParseConfig(yaml, "big.yaml");
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->policy.params.size(), 30000u);
  Result<YamlMapReader> params = config->policy.ParamsReader();
  ASSERT_TRUE(params.ok()) << params.status().message();
  const Status unknown = params->Finish();
  EXPECT_NE(unknown.message().find("policy.k0: unknown key"), std::string::npos)
      << unknown.message();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 15.0);
}

}  // namespace
}  // namespace rubato
