// The accuracy suite's instance reader and scoring: scoring must agree with tasks.score in
// bench/accuracy/tasks.py (the cases below were checked against it), and bad instance files
// must end in errors that name the file and line; instances that cannot run are named too.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "bench/accuracy/accuracy_eval.h"
#include "bench/accuracy/accuracy_instance.h"
#include "common/test_temp_dir.h"

namespace rubato {
namespace {

TEST(AccuracyScoring, MatchesTasksScore) {
  // (continuation, answer, tasks.score(continuation, answer))
  EXPECT_TRUE(ScoreContinuation(" 48213.", "48213"));
  EXPECT_TRUE(ScoreContinuation(" 48213. Remember it.", "48213"));
  EXPECT_TRUE(ScoreContinuation(" 48213\nWhat", "48213"));
  EXPECT_TRUE(ScoreContinuation("48213", " 48213 "));
  EXPECT_TRUE(ScoreContinuation(" ABCDE FGHIJ KLMNO.", "ABCDE FGHIJ KLMNO"));
  EXPECT_FALSE(ScoreContinuation(" 4821.", "48213"));
  EXPECT_FALSE(ScoreContinuation(" 482133.", "48213"));
  EXPECT_FALSE(ScoreContinuation(" 48 213.", "48213"));
  EXPECT_FALSE(ScoreContinuation("", "48213"));
  EXPECT_FALSE(ScoreContinuation(". 48213.", "48213"));
  EXPECT_EQ(ExtractPrediction("  a1b2c3 is it.\nmore"), "a1b2c3 is it");
  EXPECT_EQ(ExtractPrediction("no end"), "no end");
}

TEST(AccuracyScoring, Utf8ByteOffsetCountsCodePoints) {
  const std::string text = "a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80z";  // a é € 😀 z
  EXPECT_EQ(*Utf8ByteOffset(text, 0), 0u);
  EXPECT_EQ(*Utf8ByteOffset(text, 1), 1u);
  EXPECT_EQ(*Utf8ByteOffset(text, 2), 3u);
  EXPECT_EQ(*Utf8ByteOffset(text, 3), 6u);
  EXPECT_EQ(*Utf8ByteOffset(text, 4), 10u);
  EXPECT_EQ(*Utf8ByteOffset(text, 5), 11u);
  EXPECT_FALSE(Utf8ByteOffset(text, 6).ok());
  EXPECT_FALSE(Utf8ByteOffset(text, -1).ok());
}

class AccuracyInstanceFile : public ::testing::Test {
 protected:
  std::filesystem::path Write(const std::string& text) {
    return dir_.WriteFile("tasks.jsonl", text);
  }
  TestTempDir dir_;
};

const char* const kGoodLine =
    R"({"id": "passkey/2048/0.5/0", "task": "passkey", "length": 2048, "depth": 0.5, )"
    R"("prompt": "x \u00e9 The pass key is 1.\nWhat?", "answer": "1", "asked_char_offset": 4})";

TEST_F(AccuracyInstanceFile, ReadsInstances) {
  const auto instances = LoadAccuracyInstances(Write(std::string(kGoodLine) + "\n\n" + kGoodLine));
  ASSERT_TRUE(instances.ok()) << instances.status().message();
  ASSERT_EQ(instances->size(), 2u);
  const AccuracyInstance& first = (*instances)[0];
  EXPECT_EQ(first.id, "passkey/2048/0.5/0");
  EXPECT_EQ(first.length, 2048);
  EXPECT_DOUBLE_EQ(first.depth, 0.5);
  EXPECT_EQ(first.answer, "1");
  EXPECT_EQ(first.prompt.substr(*Utf8ByteOffset(first.prompt, first.asked_char_offset), 3), "The");
}

TEST_F(AccuracyInstanceFile, ErrorsNameFileAndLine) {
  struct Case {
    std::string text;
    std::string expected;  // substring of the error
  };
  std::string missing_answer = kGoodLine;
  missing_answer.replace(missing_answer.find("\"answer\""), 8, "\"answr\"");
  std::string far_offset = kGoodLine;
  far_offset.replace(far_offset.find(": 4}"), 4, ": 400}");
  std::string bad_depth = kGoodLine;
  bad_depth.replace(bad_depth.find("0.5, "), 3, "1.5");
  const Case cases[] = {
      {"", "no instances"},
      {std::string(kGoodLine) + "\n{not json", "tasks.jsonl:2: not a JSON object"},
      {missing_answer, "tasks.jsonl:1: missing key 'answer'"},
      {far_offset, "tasks.jsonl:1: asked_char_offset 400 lies outside the prompt"},
      {bad_depth, "tasks.jsonl:1: depth must lie in [0, 1]"},
  };
  for (const Case& c : cases) {
    const auto instances = LoadAccuracyInstances(Write(c.text));
    ASSERT_FALSE(instances.ok()) << c.text;
    EXPECT_NE(instances.status().message().find(c.expected), std::string::npos)
        << instances.status().message();
  }
  EXPECT_FALSE(LoadAccuracyInstances(dir_.path() / "absent.jsonl").ok());
}

AccuracyInstance InstanceWithPrompt(std::string prompt) {
  AccuracyInstance instance;
  instance.id = "passkey/8192/0/0";
  instance.task = "passkey";
  instance.length = 8192;
  instance.prompt = std::move(prompt);
  instance.answer = "1";
  return instance;
}

TEST(AccuracyEvalErrors, InstanceLongerThanTheContextIsNamed) {
  RubatoConfig config = DefaultConfig();
  config.model.path = "models/tiny-qwen3-longctx";  // 8192-token context
  std::string prompt;
  for (int i = 0; i < 8200; ++i) prompt += " 7";  // at least one token per repetition
  const std::vector<AccuracyInstance> instances = {InstanceWithPrompt(prompt)};
  const auto result = RunAccuracyEval(config, instances, AccuracyEvalOptions{});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(result.status().message().find("instance 'passkey/8192/0/0' has"), std::string::npos)
      << result.status().message();
}

TEST(AccuracyEvalErrors, MissingModelDirectory) {
  RubatoConfig config = DefaultConfig();
  config.model.path = "/nonexistent/model";
  const std::vector<AccuracyInstance> instances = {InstanceWithPrompt("x")};
  const auto result = RunAccuracyEval(config, instances, AccuracyEvalOptions{});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().message(), "model directory '/nonexistent/model' does not exist");
}

// What `rubato generate` refuses before loading, the runner refuses too, by name.
TEST(AccuracyEvalErrors, UnsupportedBackendAndResidencyChoicesAreNamed) {
  RubatoConfig config = DefaultConfig();
  config.model.path = "models/tiny-qwen3-longctx";
  config.engine.backend = EngineSection::Backend::kCuda;
  config.engine.dtype = DType::kF32;  // no build runs this: CUDA is bf16 only
  const std::vector<AccuracyInstance> instances = {InstanceWithPrompt("x")};
  auto result = RunAccuracyEval(config, instances, AccuracyEvalOptions{});
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(result.status().message().find("engine."), std::string::npos)
      << result.status().message();

  config = DefaultConfig();
  config.model.path = "models/tiny-qwen3-longctx";
  config.policy.name = "sfi";
  config.engine.kv_residency = "offloaded";
  result = RunAccuracyEval(config, instances, AccuracyEvalOptions{});
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("policy 'sfi' does not support offloaded KV"),
            std::string::npos)
      << result.status().message();
}

}  // namespace
}  // namespace rubato
