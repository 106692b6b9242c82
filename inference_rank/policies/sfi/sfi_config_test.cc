// Tests for the SFI policy: the slow/fast step schedule on scripted and random token streams
// (against a window-based restatement of the rule), config parsing (defaults, every key, every
// bad value with its key path, unknown keys, configs built in code), and trigger resolution on
// the bundled tokenizers (ids checked by decoding them).
#include "inference_rank/policies/sfi/sfi_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "common/text_file.h"

namespace rubato {
namespace {

// ---------------------------------------------------------------------------------------------
// Step schedule

// Drives `schedule` over `tokens` (the token each decode step generates, in order), executing
// whatever it asks for, and returns the kinds as a string: 'S' slow, 'F' fast.
std::string StepKinds(SfiSchedule& schedule, const std::vector<int>& tokens) {
  std::string kinds;
  for (const int token : tokens) {
    const SfiStepKind kind = schedule.NextStep();
    kinds += kind == SfiStepKind::kSlow ? 'S' : 'F';
    schedule.OnStep(kind, token);
  }
  return kinds;
}

// Sorted, as ResolveTriggerTokens returns them.
const std::vector<int> kTriggers = {5, 9, 12};

TEST(SfiSchedule, FirstDecodeStepIsSlow) {
  SfiSchedule schedule(64, &kTriggers);
  EXPECT_EQ(schedule.NextStep(), SfiStepKind::kSlow);
  EXPECT_EQ(schedule.slow_steps(), 0);
  EXPECT_EQ(schedule.fast_steps(), 0);
  SfiSchedule no_triggers(64, nullptr);
  EXPECT_EQ(no_triggers.NextStep(), SfiStepKind::kSlow);
  // Whatever the first token is, the step after a slow one is fast unless it was a trigger.
  EXPECT_EQ(StepKinds(schedule, {1, 1}), "SF");
}

TEST(SfiSchedule, TMaxThreeForcesASlowStepAfterThreeFastOnes) {
  SfiSchedule schedule(3, &kTriggers);
  EXPECT_EQ(StepKinds(schedule, std::vector<int>(12, 1)), "SFFFSFFFSFFF");
  EXPECT_EQ(schedule.NextStep(), SfiStepKind::kSlow);
  EXPECT_EQ(schedule.slow_steps(), 3);
  EXPECT_EQ(schedule.fast_steps(), 9);
}

TEST(SfiSchedule, TMaxSixtyFourForcesEverySixtyFifthStep) {
  SfiSchedule schedule(64, &kTriggers);
  const std::string kinds = StepKinds(schedule, std::vector<int>(200, 7));
  for (size_t step = 0; step < kinds.size(); ++step) {
    EXPECT_EQ(kinds[step], step % 65 == 0 ? 'S' : 'F') << "step " << step;
  }
  EXPECT_EQ(schedule.slow_steps(), 4);  // steps 0, 65, 130, 195
  EXPECT_EQ(schedule.fast_steps(), 196);
}

TEST(SfiSchedule, StepAfterATriggerIsSlow) {
  SfiSchedule schedule(64, &kTriggers);
  // step:            0  1  2  3  4  5  6  7   8  9
  // token generated: 1  5  2  2  9  9  3  12  4  4
  EXPECT_EQ(StepKinds(schedule, {1, 5, 2, 2, 9, 9, 3, 12, 4, 4}), "SFSFFSSFSF");
  EXPECT_EQ(schedule.slow_steps(), 5);
  EXPECT_EQ(schedule.fast_steps(), 5);
  // A trigger produced by the very first (slow) step makes the second slow too.
  SfiSchedule first(64, &kTriggers);
  EXPECT_EQ(StepKinds(first, {9, 1, 1}), "SSF");
}

TEST(SfiSchedule, TriggerRightAfterAForcedSlowStep) {
  SfiSchedule schedule(3, &kTriggers);
  // Step 4 is forced slow by t_max and generates the trigger 5: step 5 is slow as well, and
  // the three fast steps allowed by t_max count from step 5.
  EXPECT_EQ(StepKinds(schedule, {1, 1, 1, 1, 5, 1, 1, 1, 1, 1}), "SFFFSSFFFS");
}

TEST(SfiSchedule, TriggerAndTMaxDueTogetherGiveOneSlowStep) {
  SfiSchedule schedule(3, &kTriggers);
  // Step 3 is the third fast step and generates a trigger: step 4 is slow for both reasons.
  EXPECT_EQ(StepKinds(schedule, {1, 1, 1, 5, 1, 1, 1, 1}), "SFFFSFFF");
  EXPECT_EQ(schedule.NextStep(), SfiStepKind::kSlow);
}

TEST(SfiSchedule, ATriggerSlowStepRestartsTheTMaxCount) {
  SfiSchedule schedule(3, &kTriggers);
  EXPECT_EQ(StepKinds(schedule, {1, 5, 1, 1, 1}), "SFSFF");
  EXPECT_EQ(schedule.NextStep(), SfiStepKind::kFast);  // only two fast steps since step 2
  schedule.OnStep(SfiStepKind::kFast, 1);
  EXPECT_EQ(schedule.NextStep(), SfiStepKind::kSlow);
}

TEST(SfiSchedule, TMaxOneAlternatesAndNonPositiveTMaxIsAlwaysSlow) {
  SfiSchedule one(1, nullptr);
  EXPECT_EQ(StepKinds(one, std::vector<int>(6, 1)), "SFSFSF");
  SfiSchedule zero(0, &kTriggers);
  EXPECT_EQ(StepKinds(zero, {1, 2, 3}), "SSS");
  SfiSchedule negative(-4, &kTriggers);
  EXPECT_EQ(StepKinds(negative, {1, 2, 3}), "SSS");
}

TEST(SfiSchedule, CallerMayRunASlowStepWhenAFastOneWasDue) {
  SfiSchedule schedule(3, &kTriggers);
  EXPECT_EQ(StepKinds(schedule, {1, 1}), "SF");
  ASSERT_EQ(schedule.NextStep(), SfiStepKind::kFast);
  schedule.OnStep(SfiStepKind::kSlow, 1);  // e.g. the engine refreshed early
  EXPECT_EQ(schedule.slow_steps(), 2);
  EXPECT_EQ(StepKinds(schedule, std::vector<int>(4, 1)), "FFFS");
}

TEST(SfiSchedule, DiscardedFastStepMakesTheNextStepSlow) {
  SfiSchedule schedule(3, &kTriggers);
  EXPECT_EQ(StepKinds(schedule, {1, 1}), "SF");
  ASSERT_EQ(schedule.NextStep(), SfiStepKind::kFast);
  schedule.OnFastStepDiscarded();  // the confidence trigger threw the fast step away
  EXPECT_EQ(schedule.NextStep(), SfiStepKind::kSlow);
  EXPECT_EQ(schedule.NextStep(), SfiStepKind::kSlow);  // asking again does not consume it
  EXPECT_EQ(schedule.fast_steps(), 1);
  EXPECT_EQ(schedule.discarded_steps(), 1);
  // The redo ran as a slow step: the t_max count restarts from it.
  EXPECT_EQ(StepKinds(schedule, std::vector<int>(5, 1)), "SFFFS");
  EXPECT_EQ(schedule.slow_steps(), 3);
}

TEST(SfiSchedule, TokensOutsideTheTriggerSetAreOrdinary) {
  SfiSchedule schedule(64, &kTriggers);
  EXPECT_EQ(StepKinds(schedule, {-1, 4, 6, 8, 10, 11, 13, 1 << 30, 2}), "SFFFFFFFF");
}

// The rule restated over the whole history: step t is slow iff t == 0, the token of step t - 1
// is a trigger, or steps t - t_max .. t - 1 were all fast.
std::string ReferenceKinds(int t_max, const std::vector<int>& triggers,
                           const std::vector<int>& tokens) {
  std::string kinds;
  for (size_t t = 0; t < tokens.size(); ++t) {
    bool slow = t == 0 || std::binary_search(triggers.begin(), triggers.end(), tokens[t - 1]);
    if (!slow && t >= static_cast<size_t>(t_max)) {
      slow = kinds.compare(t - t_max, t_max, std::string(t_max, 'F')) == 0;
    }
    kinds += slow ? 'S' : 'F';
  }
  return kinds;
}

TEST(SfiSchedule, MatchesTheRuleOnRandomStreams) {
  std::mt19937 rng(20240611);
  for (const int t_max : {1, 2, 3, 7, 64}) {
    for (const double trigger_share : {0.0, 0.02, 0.2, 0.6}) {
      std::bernoulli_distribution is_trigger(trigger_share);
      std::uniform_int_distribution<int> pick(0, static_cast<int>(kTriggers.size()) - 1);
      std::vector<int> tokens(600);
      for (int& token : tokens) token = is_trigger(rng) ? kTriggers[pick(rng)] : 100;
      SfiSchedule schedule(t_max, &kTriggers);
      const std::string kinds = StepKinds(schedule, tokens);
      EXPECT_EQ(kinds, ReferenceKinds(t_max, kTriggers, tokens))
          << "t_max " << t_max << ", trigger share " << trigger_share;
      EXPECT_EQ(kinds.find(std::string(t_max + 1, 'F')), std::string::npos);
      EXPECT_EQ(schedule.slow_steps() + schedule.fast_steps(), 600);
      EXPECT_EQ(schedule.slow_steps(), std::count(kinds.begin(), kinds.end(), 'S'));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Config

Result<SfiPolicyConfig> Parse(const std::string& yaml) {
  auto config = ParseConfig(yaml, "s.yaml");
  if (!config.ok()) return config.status();
  return ParseSfiPolicyConfig(config->policy);
}

TEST(SfiPolicyConfig, DefaultsAreDesignFourTwo) {
  auto config = Parse("policy: {name: sfi}\n");
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->sink_tokens, 4);
  EXPECT_EQ(config->recent_window, 256);
  EXPECT_EQ(config->t_max, 64);
  EXPECT_EQ(config->prefill_window, 16);
  EXPECT_EQ(config->triggers, (std::vector<std::string>{".", "?", "!", ";", "\n"}));
  const SfiSelectorConfig& s = config->selector;
  EXPECT_EQ(s.budget, 2048);
  EXPECT_EQ(s.alpha, 0.5);
  EXPECT_EQ(s.gamma, 0.0);
  EXPECT_EQ(s.beta, -std::log(0.6) / 0.9);
  EXPECT_EQ(s.p, 1.8);
  EXPECT_EQ(s.eta, 0.4);
  EXPECT_EQ(s.lambda_clip, 0.02);
  EXPECT_EQ(s.epsilon, 1e-8);
  EXPECT_EQ(s.nms_window, 32);
  EXPECT_EQ(s.alpha_soft, 0.5);
  EXPECT_EQ(s.alpha_cross, 0.35);
  EXPECT_EQ(s.temperature, 2.0);
  EXPECT_EQ(s.continuation, 8);
  EXPECT_EQ(s.continuation_threshold, 0.01);
  EXPECT_TRUE(ValidateSfiPolicyConfig(SfiPolicyConfig()).ok());
}

TEST(SfiPolicyConfig, ReadsEveryKey) {
  auto config = Parse(
      "policy:\n"
      "  name: sfi\n"
      "  sink_tokens: 0\n"
      "  recent_window: 1\n"
      "  budget: 7\n"
      "  t_max: 3\n"
      "  prefill_window: 64\n"
      "  triggers: [\"\\n\\n\", '.', \"\\u3002\", '\\n']\n"
      "  alpha: 1\n"
      "  gamma: 0.25\n"
      "  beta: 0\n"
      "  p: 1\n"
      "  eta: 2.5\n"
      "  lambda_clip: 1\n"
      "  epsilon: 1e-12\n"
      "  nms_window: 1\n"
      "  alpha_soft: 0\n"
      "  alpha_cross: 1.5\n"
      "  temperature: 0.5\n"
      "  continuation: 0\n"
      "  continuation_threshold: 0.25\n"
      "  confidence_threshold: 0.125\n");
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->sink_tokens, 0);
  EXPECT_EQ(config->recent_window, 1);
  EXPECT_EQ(config->t_max, 3);
  EXPECT_EQ(config->prefill_window, 64);
  EXPECT_EQ(config->confidence_threshold, 0.125);
  // Double-quoted YAML escapes arrive decoded; single quotes keep the backslash.
  EXPECT_EQ(config->triggers,
            (std::vector<std::string>{"\n\n", ".", "\xe3\x80\x82", std::string("\\n")}));
  const SfiSelectorConfig& s = config->selector;
  EXPECT_EQ(s.budget, 7);
  EXPECT_EQ(s.alpha, 1.0);
  EXPECT_EQ(s.gamma, 0.25);
  EXPECT_EQ(s.beta, 0.0);
  EXPECT_EQ(s.p, 1.0);
  EXPECT_EQ(s.eta, 2.5);
  EXPECT_EQ(s.lambda_clip, 1.0);
  EXPECT_EQ(s.epsilon, 1e-12);
  EXPECT_EQ(s.nms_window, 1);
  EXPECT_EQ(s.alpha_soft, 0.0);
  EXPECT_EQ(s.alpha_cross, 1.5);
  EXPECT_EQ(s.temperature, 0.5);
  EXPECT_EQ(s.continuation, 0);
  EXPECT_EQ(s.continuation_threshold, 0.25);
}

TEST(SfiPolicyConfig, EmptyTriggerListLeavesOnlyTMax) {
  auto config = Parse("policy: {name: sfi, triggers: []}\n");
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_TRUE(config->triggers.empty());
}

TEST(SfiPolicyConfig, RejectsBadValuesNamingTheKeyPath) {
  const struct {
    const char* params;  // inside "policy: {name: sfi, ...}"
    const char* message_start;
  } cases[] = {
      {"sink_tokens: -1", "s.yaml: policy.sink_tokens: must be in [0, 2147483647], got -1"},
      {"recent_window: 0", "s.yaml: policy.recent_window: must be in [1, 2147483647], got 0"},
      {"budget: 0", "s.yaml: policy.budget: must be in [1, 2147483647], got 0"},
      {"budget: 4096.5", "s.yaml: policy.budget: expected an integer, got '4096.5'"},
      {"t_max: 0", "s.yaml: policy.t_max: must be in [1, 2147483647], got 0"},
      {"t_max: 99999999999", "s.yaml: policy.t_max: must be in [1, 2147483647], got 99999999999"},
      {"prefill_window: 0", "s.yaml: policy.prefill_window: must be in [1, 64], got 0"},
      {"prefill_window: 65", "s.yaml: policy.prefill_window: must be in [1, 64], got 65"},
      {"triggers: '.'", "s.yaml: policy.triggers: expected a list of strings, got '.'"},
      {"triggers: ['.', '']", "s.yaml: policy.triggers[1]: '' must not be empty"},
      {"triggers: ['. ']", "s.yaml: policy.triggers[0]: '. ' ends with a space or tab"},
      {"triggers: [\"\\n\\t\"]", "s.yaml: policy.triggers[0]: '\\n\\t' ends with a space or tab"},
      {"triggers: [[a]]", "s.yaml: policy.triggers[0]: expected a string, got a list"},
      {"confidence_threshold: 1", "s.yaml: policy.confidence_threshold: must be in [0, 1), got 1"},
      {"confidence_threshold: -0.5",
       "s.yaml: policy.confidence_threshold: must be in [0, 1), got -0.5"},
      {"alpha: 0", "s.yaml: policy.alpha: must be in (0, 1], got 0"},
      {"alpha: 1.5", "s.yaml: policy.alpha: must be in (0, 1], got 1.5"},
      {"gamma: -0.1", "s.yaml: policy.gamma: must be in [0, inf), got -0.1"},
      {"beta: -1", "s.yaml: policy.beta: must be in [0, inf), got -1"},
      {"p: 0.5", "s.yaml: policy.p: must be in [1, inf), got 0.5"},
      {"eta: -2", "s.yaml: policy.eta: must be in [0, inf), got -2"},
      {"lambda_clip: 1.01", "s.yaml: policy.lambda_clip: must be in [0, 1], got 1.01"},
      {"lambda_clip: -0.5", "s.yaml: policy.lambda_clip: must be in [0, 1], got -0.5"},
      {"epsilon: 0", "s.yaml: policy.epsilon: must be in (0, inf), got 0"},
      {"epsilon: .inf", "s.yaml: policy.epsilon: expected a number, got '.inf'"},
      {"nms_window: 0", "s.yaml: policy.nms_window: must be in [1, 2147483647], got 0"},
      {"alpha_soft: -0.5", "s.yaml: policy.alpha_soft: must be in [0, inf), got -0.5"},
      {"alpha_cross: -1", "s.yaml: policy.alpha_cross: must be in [0, inf), got -1"},
      {"temperature: 0", "s.yaml: policy.temperature: must be in (0, inf), got 0"},
      {"temperature: .nan", "s.yaml: policy.temperature: expected a number, got '.nan'"},
      {"temperature: '2'", "s.yaml: policy.temperature: expected a number, got the quoted"},
      {"continuation: -1", "s.yaml: policy.continuation: must be in [0, 2147483647], got -1"},
      {"continuation_threshold: 0",
       "s.yaml: policy.continuation_threshold: must be in (0, 1], got 0"},
      {"continuation_threshold: 1.5",
       "s.yaml: policy.continuation_threshold: must be in (0, 1], got 1.5"},
      {"budgte: 10", "s.yaml: policy.budgte: unknown key; did you mean 'budget'?"},
      {"window: 8", "s.yaml: policy.window: unknown key"},
  };
  for (const auto& c : cases) {
    const std::string yaml = std::string("policy: {name: sfi, ") + c.params + "}\n";
    auto rejected = Parse(yaml);
    ASSERT_FALSE(rejected.ok()) << yaml;
    EXPECT_EQ(rejected.status().code(), StatusCode::kInvalidArgument) << yaml;
    EXPECT_EQ(rejected.status().message().rfind(c.message_start, 0), 0u)
        << yaml << " -> " << rejected.status().message();
  }
}

TEST(SfiPolicyConfig, ValidateChecksConfigsBuiltInCode) {
  const struct {
    void (*edit)(SfiPolicyConfig&);
    const char* message;
  } cases[] = {
      {[](SfiPolicyConfig& c) { c.sink_tokens = -1; },
       "SfiPolicyConfig.sink_tokens = -1 is outside [0, inf)"},
      {[](SfiPolicyConfig& c) { c.recent_window = 0; },
       "SfiPolicyConfig.recent_window = 0 is outside [1, inf)"},
      {[](SfiPolicyConfig& c) { c.t_max = 0; }, "SfiPolicyConfig.t_max = 0 is outside [1, inf)"},
      {[](SfiPolicyConfig& c) { c.prefill_window = 65; },
       "SfiPolicyConfig.prefill_window = 65 is outside [1, 64]"},
      {[](SfiPolicyConfig& c) { c.confidence_threshold = 1.0; },
       "SfiPolicyConfig.confidence_threshold = 1 is outside [0, 1)"},
      {[](SfiPolicyConfig& c) {
         c.triggers = {".", ""};
       },
       "SfiPolicyConfig.triggers[1] '' must not be empty"},
      {[](SfiPolicyConfig& c) { c.triggers = {"\n "}; },
       "SfiPolicyConfig.triggers[0] '\\n ' ends with a space or tab, but token text is compared "
       "without its trailing spaces and tabs"},
  };
  for (const auto& c : cases) {
    SfiPolicyConfig config;
    c.edit(config);
    EXPECT_EQ(ValidateSfiPolicyConfig(config).message(), c.message);
  }
  // The selector's own checks run too.
  SfiPolicyConfig config;
  config.selector.budget = 0;
  const Status status = ValidateSfiPolicyConfig(config);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("budget"), std::string::npos) << status.message();
}

// The parser's ranges are the selector's: every boundary value the parser accepts, the selector
// accepts (ParseSfiPolicyConfig validates its result, so a drift shows up as a parse error).
TEST(SfiPolicyConfig, ParserBoundariesPassTheSelectorValidation) {
  const char* const boundaries[] = {
      "alpha: 1e-300", "alpha: 1", "gamma: 0", "beta: 0", "p: 1", "eta: 0", "lambda_clip: 0",
      "lambda_clip: 1", "epsilon: 1e-300", "nms_window: 1", "alpha_soft: 0", "alpha_cross: 0",
      "temperature: 1e-300", "budget: 1", "budget: 2147483647", "prefill_window: 1",
      "continuation: 0", "continuation: 2147483647", "continuation_threshold: 1e-300",
      "continuation_threshold: 1", "confidence_threshold: 0", "confidence_threshold: 0.999999"};
  for (const char* params : boundaries) {
    const std::string yaml = std::string("policy: {name: sfi, ") + params + "}\n";
    auto config = Parse(yaml);
    EXPECT_TRUE(config.ok()) << yaml << " -> " << config.status().message();
  }
}

// ---------------------------------------------------------------------------------------------
// Trigger resolution

std::unique_ptr<Tokenizer> Load(const std::string& dir) {
  auto loaded = Tokenizer::LoadFromDirectory(dir);
  EXPECT_TRUE(loaded.ok()) << loaded.status().message();
  return loaded.ok() ? std::move(loaded).value() : nullptr;
}

// The id of the vocabulary entry `token` (byte-level form: "Ġ" is a space, "Ċ" a newline),
// checked to decode to `text`; -1 (and a failure) otherwise.
int IdDecodingTo(const Tokenizer& tokenizer, const std::string& token, const std::string& text) {
  const std::optional<int> id = tokenizer.TokenToId(token);
  EXPECT_TRUE(id.has_value()) << "no token '" << token << "'";
  if (!id.has_value()) return -1;
  const int ids[] = {*id};
  EXPECT_EQ(tokenizer.Decode(ids), text) << "token '" << token << "' (id " << *id << ")";
  return *id;
}

bool Contains(const std::vector<int>& sorted, int id) {
  return std::binary_search(sorted.begin(), sorted.end(), id);
}

const std::vector<std::string> kDefaultTriggers = SfiPolicyConfig().triggers;

TEST(SfiTriggerTokens, DefaultTriggersOnTheTrainedTinyModel) {
  const std::unique_ptr<Tokenizer> tokenizer = Load("models/tiny-qwen3-longctx");
  ASSERT_NE(tokenizer, nullptr);
  auto ids = ResolveTriggerTokens(*tokenizer, kDefaultTriggers);
  ASSERT_TRUE(ids.ok()) << ids.status().message();
  EXPECT_TRUE(std::is_sorted(ids->begin(), ids->end()));
  EXPECT_EQ(std::adjacent_find(ids->begin(), ids->end()), ids->end());  // unique

  const struct {
    const char* token;
    const char* text;
    bool trigger;
  } cases[] = {
      {".", ".", true},    {"?", "?", true},   {"!", "!", true},        {";", ";", true},
      {"Ċ", "\n", true},   {"Ġ.", " .", true}, {"...", "...", true},    {"Ġ...", " ...", true},
      {".Ċ", ".\n", true}, {"??", "??", true}, {").", ").", true},      {",", ",", false},
      {":", ":", false},   {"ĉ", "\t", false}, {"Ġthe", " the", false},
  };
  for (const auto& c : cases) {
    const int id = IdDecodingTo(*tokenizer, c.token, c.text);
    EXPECT_EQ(Contains(*ids, id), c.trigger) << "'" << c.token << "' (id " << id << ")";
  }
  // Special tokens never count, whatever their text.
  for (const int id : *ids) EXPECT_FALSE(tokenizer->IsSpecialToken(id)) << id;
}

TEST(SfiTriggerTokens, ExactSetOnTheHandMadeTokenizer) {
  // tiny_bpe: 256 byte tokens and a few merges, none of which contains . ? ! ; or a newline.
  const std::unique_ptr<Tokenizer> tokenizer = Load("tests/data/tokenizer/tiny_bpe");
  ASSERT_NE(tokenizer, nullptr);
  auto ids = ResolveTriggerTokens(*tokenizer, kDefaultTriggers);
  ASSERT_TRUE(ids.ok()) << ids.status().message();
  std::vector<int> expected = {
      IdDecodingTo(*tokenizer, ".", "."),  IdDecodingTo(*tokenizer, "?", "?"),
      IdDecodingTo(*tokenizer, "!", "!"),  IdDecodingTo(*tokenizer, ";", ";"),
      IdDecodingTo(*tokenizer, "Ċ", "\n"),
  };
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(*ids, expected);
}

TEST(SfiTriggerTokens, SpecialTokensAreSkippedAddedOnesAreNot) {
  const std::unique_ptr<Tokenizer> tokenizer = Load("tests/data/tokenizer/tiny_bpe");
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<std::string> triggers = {">"};
  auto ids = ResolveTriggerTokens(*tokenizer, triggers);
  ASSERT_TRUE(ids.ok()) << ids.status().message();
  const int think = *tokenizer->TokenToId("<think>");  // added, not special
  const int end = *tokenizer->TokenToId("<|end|>");    // special
  const int bos = *tokenizer->TokenToId("<bos>");      // special
  ASSERT_FALSE(tokenizer->IsSpecialToken(think));
  ASSERT_TRUE(tokenizer->IsSpecialToken(end));
  EXPECT_EQ(*ids, (std::vector<int>{IdDecodingTo(*tokenizer, ">", ">"), think}));
  EXPECT_FALSE(Contains(*ids, end));
  EXPECT_FALSE(Contains(*ids, bos));
}

TEST(SfiTriggerTokens, EveryIdUpToTheLastIsConsidered) {
  // tiny_bpe's last id is the added, not special, token "café" written decomposed (e + U+0301);
  // no other token ends with the combining accent (its two byte tokens decode to U+FFFD alone).
  const std::unique_ptr<Tokenizer> tokenizer = Load("tests/data/tokenizer/tiny_bpe");
  ASSERT_NE(tokenizer, nullptr);
  const int last = tokenizer->vocab_size() - 1;
  const int ids_of_last[] = {last};
  ASSERT_EQ(tokenizer->Decode(ids_of_last), "cafe\xcc\x81");
  ASSERT_FALSE(tokenizer->IsSpecialToken(last));
  const std::vector<std::string> triggers = {"e\xcc\x81"};
  auto ids = ResolveTriggerTokens(*tokenizer, triggers);
  ASSERT_TRUE(ids.ok()) << ids.status().message();
  EXPECT_EQ(*ids, std::vector<int>{last});
}

// tiny_bpe with extra vocabulary entries that end in white space, to pin the trailing-space rule.
std::unique_ptr<Tokenizer> TinyWithWhiteSpaceTokens() {
  const std::string dir = "tests/data/tokenizer/tiny_bpe";
  auto json_text = ReadTextFile(dir + "/tokenizer.json");
  auto config_text = ReadTextFile(dir + "/tokenizer_config.json");
  EXPECT_TRUE(json_text.ok() && config_text.ok());
  if (!json_text.ok() || !config_text.ok()) return nullptr;
  nlohmann::json json = nlohmann::json::parse(*json_text);
  int id = 283;  // after the added tokens (276..282)
  for (const char* token : {".Ġ", "?ĉ", ".ĊĠĠ", "ĠĠ", ".Ġx", "Ċ.", "!Ġ)", "ĉĊĉ"}) {
    json["model"]["vocab"][token] = id++;
  }
  auto loaded = Tokenizer::LoadFromJson(json.dump(), *config_text, "tiny_bpe+");
  EXPECT_TRUE(loaded.ok()) << loaded.status().message();
  return loaded.ok() ? std::move(loaded).value() : nullptr;
}

TEST(SfiTriggerTokens, TrailingSpacesAndTabsAreIgnoredNewlinesAreNot) {
  const std::unique_ptr<Tokenizer> tokenizer = TinyWithWhiteSpaceTokens();
  ASSERT_NE(tokenizer, nullptr);
  auto ids = ResolveTriggerTokens(*tokenizer, kDefaultTriggers);
  ASSERT_TRUE(ids.ok()) << ids.status().message();
  const struct {
    const char* token;
    const char* text;
    bool trigger;
  } cases[] = {
      {".Ġ", ". ", true},       // "." once the space is cut
      {"?ĉ", "?\t", true},      // tabs are cut too
      {".ĊĠĠ", ".\n  ", true},  // ends with "\n" once the spaces are cut
      {"ĉĊĉ", "\t\n\t", true},  // ends with "\n" once the tab is cut
      {"Ċ.", "\n.", true},      // ends with "."
      {"ĠĠ", "  ", false},      // white space only
      {".Ġx", ". x", false},    // "." inside
      {"!Ġ)", "! )", false},    // "!" inside
  };
  for (const auto& c : cases) {
    const int id = IdDecodingTo(*tokenizer, c.token, c.text);
    EXPECT_EQ(Contains(*ids, id), c.trigger) << "'" << c.token << "' (id " << id << ")";
  }
}

TEST(SfiTriggerTokens, ErrorsNameTheTrigger) {
  const std::unique_ptr<Tokenizer> tokenizer = Load("tests/data/tokenizer/tiny_bpe");
  ASSERT_NE(tokenizer, nullptr);
  const struct {
    std::vector<std::string> triggers;
    const char* message_start;
  } cases[] = {
      {{".", "<<END>>"}, "sfi trigger '<<END>>': matches no token of the vocabulary"},
      // One line: the newlines of the trigger are escaped in the message.
      {{"\n\n\n\n"}, "sfi trigger '\\n\\n\\n\\n': matches no token of the vocabulary"},
      {{"", "."}, "sfi trigger '': must not be empty"},
      {{". "}, "sfi trigger '. ': ends with a space or tab"},
  };
  for (const auto& c : cases) {
    auto ids = ResolveTriggerTokens(*tokenizer, c.triggers);
    ASSERT_FALSE(ids.ok()) << c.message_start;
    EXPECT_EQ(ids.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(ids.status().message().rfind(c.message_start, 0), 0u) << ids.status().message();
  }
  // No triggers: no ids, no error.
  auto none = ResolveTriggerTokens(*tokenizer, std::vector<std::string>{});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(SfiTriggerTokens, ScheduleOverEncodedText) {
  const std::unique_ptr<Tokenizer> tokenizer = Load("models/tiny-qwen3-longctx");
  ASSERT_NE(tokenizer, nullptr);
  auto ids = ResolveTriggerTokens(*tokenizer, kDefaultTriggers);
  ASSERT_TRUE(ids.ok()) << ids.status().message();
  // As if the model generated this text token by token.
  const std::vector<int> tokens = tokenizer->Encode("The cat sat. Did it stay? Yes it did");
  SfiSchedule schedule(64, &*ids);
  const std::string kinds = StepKinds(schedule, tokens);
  const int period = IdDecodingTo(*tokenizer, ".", ".");
  const int question = IdDecodingTo(*tokenizer, "?", "?");
  int slow_after_punctuation = 0;
  for (size_t t = 1; t < tokens.size(); ++t) {
    const bool after_punctuation = tokens[t - 1] == period || tokens[t - 1] == question;
    EXPECT_EQ(kinds[t], after_punctuation ? 'S' : 'F') << "step " << t << ": " << kinds;
    slow_after_punctuation += after_punctuation ? 1 : 0;
  }
  EXPECT_EQ(slow_after_punctuation, 2);
}

}  // namespace
}  // namespace rubato
