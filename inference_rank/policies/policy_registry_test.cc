// Tests for policy-name and parameter validation.
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
            "p.yaml: policy.name: unknown policy 'quest9' (known: dense)");
}

}  // namespace
}  // namespace rubato
