// Tests for policy-name and parameter validation: dense, streaming_llm, sfi and oracle_topk
// (defaults, values, range and unknown-key errors naming the key path), the old offload_*
// spellings, and policy x residency refusals. sfi/sfi_config_test.cc checks every SFI range.
#include "inference_rank/policies/policy_registry.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"
#include "inference_rank/policies/sfi/sfi_policy.h"

namespace rubato {
namespace {

const SfiPolicyConfig& SfiConfigOf(const PolicyChoice& choice) {
  return dynamic_cast<const SfiPolicy&>(*choice.policy).config();
}

TEST(PolicyRegistry, DenseIsKnownAndTakesNoParameters) {
  auto config = ParseConfig("policy:\n  name: dense\n", "p.yaml");
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto choice = ResolvePolicy(config->policy);
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->policy->name(), "dense");
  EXPECT_EQ(choice->residency, KvResidency::kLocal);
  EXPECT_TRUE(choice->policy->window().IsDense());

  auto with_param = ParseConfig("policy:\n  name: dense\n  recent_window: 64\n", "p.yaml");
  ASSERT_TRUE(with_param.ok()) << with_param.status().message();
  auto rejected = ResolvePolicy(with_param->policy);
  ASSERT_FALSE(rejected.ok());
  EXPECT_NE(rejected.status().message().find("p.yaml: policy.recent_window"), std::string::npos)
      << rejected.status().message();
}

// Every shipped policy file loads and resolves (the tests run from the source tree), and the
// SFI ones carry what their names promise.
TEST(PolicyRegistry, ShippedPolicyFilesResolve) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator("configs/policies")) {
    if (entry.path().extension() != ".yaml") continue;
    ++files;
    auto config = LoadConfigFile(entry.path().string());
    ASSERT_TRUE(config.ok()) << config.status().message();
    auto choice = ResolvePolicy(*config);  // with the file's engine.kv_residency (longflow's)
    ASSERT_TRUE(choice.ok()) << choice.status().message();
    const std::string name = entry.path().stem().string();
    if (name.starts_with("sfi")) {
      ASSERT_EQ(choice->policy->name(), "sfi") << name;
      const SfiPolicyConfig& sfi = SfiConfigOf(*choice);
      EXPECT_EQ(sfi.selector.budget, name == "sfi_k512" ? 512 : 2048) << name;
      EXPECT_EQ(sfi.selector.continuation, name == "sfi_paper" ? 0 : 8) << name;
      EXPECT_EQ(sfi.confidence_threshold, name == "sfi_confident" ? 0.9 : 0.0) << name;
    }
  }
  EXPECT_GE(files, 7);
}

TEST(PolicyRegistry, UnknownNameListsKnownOnes) {
  auto config = ParseConfig("policy:\n  name: quest9\n", "p.yaml");
  ASSERT_TRUE(config.ok());
  auto rejected = ResolvePolicy(config->policy);
  ASSERT_FALSE(rejected.ok());
  EXPECT_EQ(rejected.status().message(),
            "p.yaml: policy.name: unknown policy 'quest9' (known: dense, streaming_llm, sfi, "
            "oracle_topk, kascade, longflow, asyncspade, synckv)");
}

TEST(PolicyRegistry, OffloadPoliciesTakeTheirSelectionParameters) {
  auto dense = ParseConfig("policy:\n  name: offload_dense\n", "p.yaml");
  ASSERT_TRUE(dense.ok());
  auto dense_choice = ResolvePolicy(dense->policy);
  ASSERT_TRUE(dense_choice.ok()) << dense_choice.status().message();
  EXPECT_EQ(dense_choice->policy->name(), "dense");
  EXPECT_EQ(dense_choice->residency, KvResidency::kOffloaded);
  ASSERT_TRUE(dense_choice->offload.has_value());
  // Dense on offloaded KV attends on the cache rank.
  EXPECT_EQ(dense_choice->offload->name, "attention");
  EXPECT_TRUE(dense_choice->policy->window().IsDense());

  auto topk = ParseConfig(
      "policy:\n  name: offload_topk\n  top_k: 64\n  sink_tokens: 2\n  recent_window: 16\n",
      "p.yaml");
  ASSERT_TRUE(topk.ok());
  auto topk_choice = ResolvePolicy(topk->policy);
  ASSERT_TRUE(topk_choice.ok()) << topk_choice.status().message();
  EXPECT_EQ(topk_choice->policy->name(), "oracle_topk");
  EXPECT_EQ(topk_choice->residency, KvResidency::kOffloaded);
  EXPECT_EQ(topk_choice->offload->name, "oracle_topk");
  EXPECT_EQ(topk_choice->offload->top_k, 64);
  EXPECT_EQ(topk_choice->offload->sink_tokens, 2);
  EXPECT_EQ(topk_choice->offload->recent_tokens, 16);

  auto defaults = ResolvePolicy(ParseConfig("policy:\n  name: offload_topk\n", "p.yaml")->policy);
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->offload->top_k, 2048);
  EXPECT_EQ(defaults->offload->sink_tokens, 4);
  EXPECT_EQ(defaults->offload->recent_tokens, 256);

  for (const std::string& bad : {std::string("policy:\n  name: offload_topk\n  top_k: 0\n"),
                                 std::string("policy:\n  name: offload_topk\n  recent_window: 0\n"),
                                 std::string("policy:\n  name: offload_dense\n  top_k: 8\n")}) {
    auto config = ParseConfig(bad, "p.yaml");
    ASSERT_TRUE(config.ok());
    auto rejected = ResolvePolicy(config->policy);
    ASSERT_FALSE(rejected.ok()) << bad;
    EXPECT_NE(rejected.status().message().find("p.yaml: policy."), std::string::npos)
        << rejected.status().message();
  }
}

Result<PolicyChoice> Resolve(const std::string& yaml) {
  auto config = ParseConfig(yaml, "s.yaml");
  if (!config.ok()) return config.status();
  return ResolvePolicy(config->policy);
}

TEST(PolicyRegistry, StreamingLlmDefaultsToSink4Recent256) {
  auto choice = Resolve("policy:\n  name: streaming_llm\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->policy->name(), "streaming_llm");
  EXPECT_EQ(choice->name, "streaming_llm");
  EXPECT_EQ(choice->policy->window(), (AttentionWindow{4, 256}));
}

TEST(PolicyRegistry, StreamingLlmReadsItsParameters) {
  auto choice = Resolve("policy: {name: streaming_llm, sink_tokens: 0, recent_window: 1}\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->policy->window(), (AttentionWindow{0, 1}));
  choice = Resolve("policy: {name: streaming_llm, sink_tokens: 16, recent_window: 1024}\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->policy->window(), (AttentionWindow{16, 1024}));
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

TEST(PolicyRegistry, KnownNamesAreTheTable) {
  EXPECT_EQ(KnownPolicyNames(),
            (std::vector<std::string>{"dense", "streaming_llm", "sfi", "oracle_topk", "kascade",
                                      "longflow", "asyncspade", "synckv"}));
}

TEST(PolicyRegistry, OracleTopKDefaultsAndParameters) {
  auto choice = Resolve("policy:\n  name: oracle_topk\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  const auto& oracle = dynamic_cast<const OracleTopKPolicy&>(*choice->policy);
  EXPECT_EQ(oracle.config().top_k, 2048);
  EXPECT_EQ(oracle.config().sink_tokens, 4);
  EXPECT_EQ(oracle.config().recent_window, 256);
  EXPECT_FALSE(choice->offload.has_value());  // local KV: the inference rank selects
  choice = Resolve("policy: {name: oracle_topk, top_k: 64, sink_tokens: 0, recent_window: 8}\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  const auto& small = dynamic_cast<const OracleTopKPolicy&>(*choice->policy);
  EXPECT_EQ(small.config().top_k, 64);
  EXPECT_EQ(small.config().sink_tokens, 0);
  EXPECT_EQ(small.config().recent_window, 8);
  auto rejected = Resolve("policy: {name: oracle_topk, top_k: 0}\n");
  ASSERT_FALSE(rejected.ok());
  EXPECT_EQ(rejected.status().message().rfind("s.yaml: policy.top_k: must be in [1, ", 0), 0u)
      << rejected.status().message();
}

// Where the KV lives is chosen apart from the policy; a policy that does not support it is
// refused by name, from its traits.
TEST(PolicyRegistry, ResidencyIsCheckedAgainstThePolicysTraits) {
  auto config = ParseConfig(
      "engine: {kv_residency: offloaded}\npolicy: {name: oracle_topk, top_k: 32}\n", "r.yaml");
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto choice = ResolvePolicy(*config);
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->residency, KvResidency::kOffloaded);
  ASSERT_TRUE(choice->offload.has_value());
  EXPECT_EQ(choice->offload->name, "oracle_topk");
  EXPECT_EQ(choice->offload->top_k, 32);

  for (const char* name : {"sfi", "streaming_llm"}) {
    auto refused = ParseConfig(
        std::string("engine: {kv_residency: offloaded}\npolicy: {name: ") + name + "}\n", "r.yaml");
    ASSERT_TRUE(refused.ok());
    auto rejected = ResolvePolicy(*refused);
    ASSERT_FALSE(rejected.ok()) << name;
    EXPECT_EQ(rejected.status().code(), StatusCode::kUnsupported);
    EXPECT_EQ(rejected.status().message(), std::string("policy '") + name +
                                               "' does not support offloaded KV (supported: "
                                               "local)");
  }
  auto split = ParseConfig("engine: {kv_residency: split_by_head}\n", "r.yaml");
  ASSERT_TRUE(split.ok()) << split.status().message();
  EXPECT_EQ(ResolvePolicy(*split).status().message(),
            "policy 'dense' does not support split_by_head KV (supported: local, offloaded)");
  auto bad = ParseConfig("engine: {kv_residency: remote}\n", "r.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("engine.kv_residency: must be auto, local, offloaded, "
                                        "evicting, split_by_head or placed"),
            std::string::npos)
      << bad.status().message();
  // Placement: offloaded KV under the table name "placed".
  auto placed = ParseConfig("engine: {kv_residency: placed}\n", "r.yaml");
  ASSERT_TRUE(placed.ok()) << placed.status().message();
  auto placed_choice = ResolvePolicy(*placed);
  ASSERT_TRUE(placed_choice.ok()) << placed_choice.status().message();
  EXPECT_EQ(placed_choice->residency, KvResidency::kOffloaded);
  EXPECT_EQ(placed_choice->residency_name, "placed");
}

TEST(PolicyRegistry, SfiDefaults) {
  auto choice = Resolve("policy:\n  name: sfi\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->policy->name(), "sfi");
  EXPECT_EQ(choice->name, "sfi");
  EXPECT_TRUE(choice->policy->window().IsDense());
  const SfiPolicyConfig& sfi = SfiConfigOf(*choice);
  EXPECT_EQ(sfi.sink_tokens, 4);
  EXPECT_EQ(sfi.recent_window, 256);
  EXPECT_EQ(sfi.t_max, 64);
  EXPECT_EQ(sfi.prefill_window, 16);
  EXPECT_EQ(sfi.triggers, (std::vector<std::string>{".", "?", "!", ";", "\n"}));
  EXPECT_EQ(sfi.selector.budget, 2048);
  EXPECT_EQ(sfi.selector.alpha, 0.5);
  EXPECT_EQ(sfi.selector.lambda_clip, 0.02);
  EXPECT_EQ(sfi.selector.nms_window, 32);
  EXPECT_EQ(sfi.selector.temperature, 2.0);
}

TEST(PolicyRegistry, SfiReadsEveryParameter) {
  auto choice = Resolve(
      "policy:\n  name: sfi\n  sink_tokens: 2\n  recent_window: 128\n  budget: 512\n"
      "  t_max: 8\n  prefill_window: 4\n  triggers: [\"\\n\\n\", '!']\n  alpha: 0.25\n"
      "  gamma: 0.5\n  beta: 1.5\n  p: 2\n  eta: 0.75\n  lambda_clip: 0.1\n  epsilon: 1e-6\n"
      "  nms_window: 16\n  alpha_soft: 0.3\n  alpha_cross: 0.2\n  temperature: 4\n");
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(choice->policy->name(), "sfi");
  const SfiPolicyConfig& sfi = SfiConfigOf(*choice);
  EXPECT_EQ(sfi.sink_tokens, 2);
  EXPECT_EQ(sfi.recent_window, 128);
  EXPECT_EQ(sfi.t_max, 8);
  EXPECT_EQ(sfi.prefill_window, 4);
  EXPECT_EQ(sfi.triggers, (std::vector<std::string>{"\n\n", "!"}));
  const SfiSelectorConfig& s = sfi.selector;
  EXPECT_EQ(s.budget, 512);
  EXPECT_EQ(s.alpha, 0.25);
  EXPECT_EQ(s.gamma, 0.5);
  EXPECT_EQ(s.beta, 1.5);
  EXPECT_EQ(s.p, 2.0);
  EXPECT_EQ(s.eta, 0.75);
  EXPECT_EQ(s.lambda_clip, 0.1);
  EXPECT_EQ(s.epsilon, 1e-6);
  EXPECT_EQ(s.nms_window, 16);
  EXPECT_EQ(s.alpha_soft, 0.3);
  EXPECT_EQ(s.alpha_cross, 0.2);
  EXPECT_EQ(s.temperature, 4.0);
}

TEST(PolicyRegistry, SfiRejectsBadValuesAndUnknownKeys) {
  const struct {
    const char* yaml;
    const char* message_start;
  } cases[] = {
      {"policy: {name: sfi, t_max: 0}\n",
       "s.yaml: policy.t_max: must be in [1, 2147483647], got 0"},
      {"policy: {name: sfi, budget: -5}\n",
       "s.yaml: policy.budget: must be in [1, 2147483647], got -5"},
      {"policy: {name: sfi, prefill_window: 100}\n",
       "s.yaml: policy.prefill_window: must be in [1, 64], got 100"},
      {"policy: {name: sfi, alpha: 2}\n", "s.yaml: policy.alpha: must be in (0, 1], got 2"},
      {"policy: {name: sfi, triggers: ['']}\n", "s.yaml: policy.triggers[0]: '' must not be empty"},
      {"policy: {name: sfi, tmax: 8}\n", "s.yaml: policy.tmax: unknown key; did you mean 't_max'?"},
      {"policy: {name: sfi, selector: {alpha: 0.5}}\n", "s.yaml: policy.selector: unknown key"},
  };
  for (const auto& c : cases) {
    auto rejected = Resolve(c.yaml);
    ASSERT_FALSE(rejected.ok()) << c.yaml;
    EXPECT_EQ(rejected.status().code(), StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_EQ(rejected.status().message().rfind(c.message_start, 0), 0u)
        << c.yaml << " -> " << rejected.status().message();
  }
}

// engine.kv_residency "auto" (the default): offloaded when a cache rank is configured, local
// where the policy supports it; an old offload_* spelling with a residency other than offloaded
// is a conflict, refused by name rather than run offloaded.
TEST(PolicyRegistry, AutoResidencyAndConflictingOldSpellings) {
  auto plain = ParseConfig("policy: {name: sfi}\n", "r.yaml");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->engine.kv_residency, "auto");
  auto sfi = ResolvePolicy(*plain);
  ASSERT_TRUE(sfi.ok()) << sfi.status().message();
  EXPECT_EQ(sfi->residency, KvResidency::kLocal);

  auto remote = ParseConfig(
      "topology: {mode: disaggregated, transport: ucx, cache_endpoints: [\"h:1\"]}\n"
      "policy: {name: dense}\n",
      "r.yaml");
  ASSERT_TRUE(remote.ok()) << remote.status().message();
  auto dense = ResolvePolicy(*remote);
  ASSERT_TRUE(dense.ok()) << dense.status().message();
  EXPECT_EQ(dense->residency, KvResidency::kOffloaded);

  auto alias = ParseConfig("policy: {name: offload_dense}\n", "r.yaml");
  ASSERT_TRUE(alias.ok());
  auto offloaded = ResolvePolicy(*alias);
  ASSERT_TRUE(offloaded.ok()) << offloaded.status().message();
  EXPECT_EQ(offloaded->residency, KvResidency::kOffloaded);

  for (const char* residency : {"local", "evicting"}) {
    auto conflict = ParseConfig(
        std::string("engine: {kv_residency: ") + residency + "}\npolicy: {name: offload_dense}\n",
        "r.yaml");
    ASSERT_TRUE(conflict.ok());
    auto refused = ResolvePolicy(*conflict);
    ASSERT_FALSE(refused.ok()) << residency;
    EXPECT_EQ(refused.status().message(),
              std::string("r.yaml: policy.name: policy 'offload_dense' is policy 'dense' on "
                          "offloaded KV, which conflicts with engine.kv_residency "
                          "(--kv-residency) ") +
                  residency + "; use --policy dense with the residency you want");
  }
  EXPECT_EQ(OffloadedAliasOf("offload_topk"), std::optional<std::string_view>("oracle_topk"));
  EXPECT_EQ(OffloadedAliasOf("dense"), std::nullopt);
}

// Parameters that size per-request state are checked against the context before the engine
// allocates: LongFlow's budget of 10^8 took 3.3 GB before its refusal, SFI's budget of 2^31 - 1
// overflowed its compact capacity into an "internal error".
TEST(PolicyRegistry, TokenCountsAboveTheContextAreRefusedByName) {
  const struct {
    const char* yaml;
    const char* needle;
  } cases[] = {
      {"policy:\n  name: longflow\n  budget: 100000000\n",
       "policy.budget: 100000000 tokens exceeds engine.max_context (4096"},
      {"policy:\n  name: sfi\n  budget: 2147483647\n",
       "policy.budget: 2147483647 tokens exceeds engine.max_context (4096"},
      {"policy:\n  name: sfi\n  recent_window: 5000\n",
       "policy.recent_window: 5000 tokens exceeds engine.max_context (4096, the longest request) "
       "and the default 256"},
      {"policy:\n  name: oracle_topk\n  top_k: 4097\n", "policy.top_k: 4097 tokens"},
  };
  for (const auto& c : cases) {
    auto config = ParseConfig(c.yaml, "p.yaml");
    ASSERT_TRUE(config.ok()) << config.status().message();
    auto choice =
        ResolvePolicy(config->policy, std::string(c.yaml).find("longflow") != std::string::npos
                                          ? KvResidency::kEvicting
                                          : KvResidency::kLocal);
    ASSERT_TRUE(choice.ok()) << choice.status().message();
    const Status limits = choice->policy->CheckLimits(4096);
    ASSERT_FALSE(limits.ok()) << c.yaml;
    EXPECT_NE(limits.message().find(c.needle), std::string::npos) << limits.message();
    EXPECT_TRUE(choice->policy->CheckLimits(std::numeric_limits<int>::max()).ok()) << c.yaml;
  }
  // The defaults pass on a context shorter than them (the paper's budgets on a small model).
  for (const char* name : {"sfi", "oracle_topk", "longflow"}) {
    auto config = ParseConfig(std::string("policy:\n  name: ") + name + "\n", "p.yaml");
    ASSERT_TRUE(config.ok()) << config.status().message();
    auto choice =
        ResolvePolicy(config->policy, std::string(name) == "longflow" ? KvResidency::kEvicting
                                                                      : KvResidency::kLocal);
    ASSERT_TRUE(choice.ok()) << choice.status().message();
    EXPECT_TRUE(choice->policy->CheckLimits(64).ok()) << name;
  }
}

TEST(PolicyRegistry, FidelityGuardIsReadBySfiAndKascadeAndRefusedByName) {
  auto sfi = ParseConfig("policy:\n  name: sfi\n  fidelity_guard: 0.5\n", "p.yaml");
  ASSERT_TRUE(sfi.ok()) << sfi.status().message();
  auto choice = ResolvePolicy(sfi->policy);
  ASSERT_TRUE(choice.ok()) << choice.status().message();
  EXPECT_EQ(SfiConfigOf(*choice).fidelity_guard, 0.5);

  auto range = ParseConfig("policy:\n  name: sfi\n  fidelity_guard: 1.5\n", "p.yaml");
  ASSERT_TRUE(range.ok());
  auto out_of_range = ResolvePolicy(range->policy);
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_NE(out_of_range.status().message().find("policy.fidelity_guard"), std::string::npos)
      << out_of_range.status().message();

  for (const char* name : {"longflow", "oracle_topk", "dense", "streaming_llm"}) {
    auto config = ParseConfig(std::string("policy:\n  name: ") + name + "\n  fidelity_guard: 0.5\n",
                              "p.yaml");
    ASSERT_TRUE(config.ok()) << config.status().message();
    auto refused = ResolvePolicy(config->policy);
    ASSERT_FALSE(refused.ok()) << name;
    EXPECT_NE(refused.status().message().find("p.yaml: policy.fidelity_guard: policy '" +
                                              std::string(name) + "' has no fidelity guard"),
              std::string::npos)
        << refused.status().message();
  }
}

}  // namespace
}  // namespace rubato
