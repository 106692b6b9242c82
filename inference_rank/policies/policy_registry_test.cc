// Tests for policy-name and parameter validation: dense, streaming_llm (defaults, values, range
// and unknown-key errors naming the key path).
#include "inference_rank/policies/policy_registry.h"

#include <gtest/gtest.h>

namespace rubato {
namespace {

TEST(PolicyRegistry, DenseIsKnownAndTakesNoParameters) {
  auto config = ParseConfig("policy:\n  name: dense\n", "p.yaml");
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto choice = ResolvePolicy(config->policy);
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->kind, PolicyKind::kDense);
  EXPECT_TRUE(choice->window.IsDense());

  auto with_param = ParseConfig("policy:\n  name: dense\n  recent_window: 64\n", "p.yaml");
  ASSERT_TRUE(with_param.ok()) << with_param.status().message();
  auto rejected = ResolvePolicy(with_param->policy);
  ASSERT_FALSE(rejected.ok());
  EXPECT_NE(rejected.status().message().find("p.yaml: policy.recent_window"), std::string::npos)
      << rejected.status().message();
}

TEST(PolicyRegistry, UnknownNameListsKnownOnes) {
  auto config = ParseConfig("policy:\n  name: quest9\n", "p.yaml");
  ASSERT_TRUE(config.ok());
  auto rejected = ResolvePolicy(config->policy);
  ASSERT_FALSE(rejected.ok());
  EXPECT_EQ(rejected.status().message(),
            "p.yaml: policy.name: unknown policy 'quest9' (known: dense, streaming_llm)");
}

Result<PolicyChoice> Resolve(const std::string& yaml) {
  auto config = ParseConfig(yaml, "s.yaml");
  if (!config.ok()) return config.status();
  return ResolvePolicy(config->policy);
}

TEST(PolicyRegistry, StreamingLlmDefaultsToSink4Recent256) {
  auto choice = Resolve("policy:\n  name: streaming_llm\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->kind, PolicyKind::kStreamingLlm);
  EXPECT_EQ(choice->name, "streaming_llm");
  EXPECT_EQ(choice->window, (AttentionWindow{4, 256}));
}

TEST(PolicyRegistry, StreamingLlmReadsItsParameters) {
  auto choice = Resolve("policy: {name: streaming_llm, sink_tokens: 0, recent_window: 1}\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->window, (AttentionWindow{0, 1}));
  choice = Resolve("policy: {name: streaming_llm, sink_tokens: 16, recent_window: 1024}\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->window, (AttentionWindow{16, 1024}));
}

TEST(PolicyRegistry, StreamingLlmRejectsOutOfRangeWrongTypeAndUnknownKeys) {
  const struct {
    const char* yaml;
    const char* message_start;
  } cases[] = {
      {"policy: {name: streaming_llm, recent_window: 0}\n",
       "s.yaml: policy.recent_window: must be in [1, 2147483647], got 0"},
      {"policy: {name: streaming_llm, sink_tokens: -1}\n",
       "s.yaml: policy.sink_tokens: must be in [0, 2147483647], got -1"},
      {"policy: {name: streaming_llm, recent_window: 1e3}\n",
       "s.yaml: policy.recent_window: expected an integer, got '1e3'"},
      {"policy: {name: streaming_llm, recent_window: 99999999999}\n",
       "s.yaml: policy.recent_window: must be in [1, 2147483647], got 99999999999"},
      {"policy: {name: streaming_llm, recent: 64}\n", "s.yaml: policy.recent: unknown key"},
  };
  for (const auto& c : cases) {
    auto rejected = Resolve(c.yaml);
    ASSERT_FALSE(rejected.ok()) << c.yaml;
    EXPECT_EQ(rejected.status().code(), StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_EQ(rejected.status().message().rfind(c.message_start, 0), 0u)
        << c.yaml << " -> " << rejected.status().message();
  }
}

}  // namespace
}  // namespace rubato
