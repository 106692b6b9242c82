// SFI policy: config parsing and validation, trigger resolution, step schedule (see sfi_config.h).
#include "inference_rank/policies/sfi/sfi_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cassert>
#include <climits>
#include <limits>
#include <string_view>

#include "common/yaml_map_reader.h"
#include "inference_rank/attention/fidelity_guard.h"

namespace rubato {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The selector's floating-point hyperparameters with the ranges ValidateSfiSelectorConfig
// enforces (its integers, budget, nms_window and continuation, are read as ints). Reading them with these ranges
// lets the YAML error name the key; ValidateSfiPolicyConfig runs after the reads in case the two
// drift apart.
struct SelectorDoubleKey {
  const char* key;
  double SfiSelectorConfig::*field;
  DoubleRange range;
};
const SelectorDoubleKey kSelectorDoubleKeys[] = {
    {"alpha", &SfiSelectorConfig::alpha, {0, 1, /*min_inclusive=*/false, true}},
    {"gamma", &SfiSelectorConfig::gamma, {0, kInf, true, false}},
    {"beta", &SfiSelectorConfig::beta, {0, kInf, true, false}},
    {"p", &SfiSelectorConfig::p, {1, kInf, true, false}},
    {"eta", &SfiSelectorConfig::eta, {0, kInf, true, false}},
    {"lambda_clip", &SfiSelectorConfig::lambda_clip, {0, 1, true, true}},
    {"epsilon", &SfiSelectorConfig::epsilon, {0, kInf, false, false}},
    {"alpha_soft", &SfiSelectorConfig::alpha_soft, {0, kInf, true, false}},
    {"alpha_cross", &SfiSelectorConfig::alpha_cross, {0, kInf, true, false}},
    {"temperature", &SfiSelectorConfig::temperature, {0, kInf, false, false}},
    {"continuation_threshold", &SfiSelectorConfig::continuation_threshold, {0, 1, false, true}},
};

// Why a trigger string can never match under the rule of sfi_config.h; empty when it can.
std::string_view TriggerProblem(std::string_view trigger) {
  if (trigger.empty()) return "must not be empty";
  if (trigger.back() == ' ' || trigger.back() == '\t') {
    return "ends with a space or tab, but token text is compared without its trailing spaces "
           "and tabs";
  }
  return {};
}

// `text` on one line for a message: newline, tab, carriage return, backslash and other control
// bytes escaped ("\n", "\x01").
std::string Escaped(std::string_view text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\\':
        out += "\\\\";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out;
}

template <typename Value>
Status FieldRangeError(std::string_view field, Value value, std::string_view range) {
  return InvalidArgumentError(
      fmt::format("SfiPolicyConfig.{} = {} is outside {}", field, value, range));
}

// A token's text as the trigger rule compares it: decoded alone, trailing spaces and tabs cut.
std::string TriggerText(const Tokenizer& tokenizer, int id) {
  const int ids[] = {id};
  std::string text = tokenizer.Decode(ids);
  const size_t last = text.find_last_not_of(" \t");
  text.resize(last == std::string::npos ? 0 : last + 1);
  return text;
}

}  // namespace

Result<SfiPolicyConfig> ParseSfiPolicyConfig(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  SfiPolicyConfig config;
  constexpr int64_t kMax = INT_MAX;
  RUBATO_RETURN_IF_ERROR(params.ReadInt("sink_tokens", 0, kMax, &config.sink_tokens));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("recent_window", 1, kMax, &config.recent_window));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("budget", 1, kMax, &config.selector.budget));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("t_max", 1, kMax, &config.t_max));
  RUBATO_RETURN_IF_ERROR(
      params.ReadInt("prefill_window", 1, kSfiMaxPrefillWindow, &config.prefill_window));
  RUBATO_RETURN_IF_ERROR(params.ReadStringList("triggers", &config.triggers));
  RUBATO_RETURN_IF_ERROR(
      params.ReadDouble("confidence_threshold", {0, 1, true, false}, &config.confidence_threshold));
  RUBATO_RETURN_IF_ERROR(ReadFidelityGuard(params, &config.fidelity_guard));
  for (size_t i = 0; i < config.triggers.size(); ++i) {
    const std::string_view problem = TriggerProblem(config.triggers[i]);
    if (!problem.empty()) {
      return params.Error(fmt::format("triggers[{}]", i),
                          fmt::format("'{}' {}", Escaped(config.triggers[i]), problem));
    }
  }
  for (const SelectorDoubleKey& key : kSelectorDoubleKeys) {
    RUBATO_RETURN_IF_ERROR(params.ReadDouble(key.key, key.range, &(config.selector.*key.field)));
  }
  RUBATO_RETURN_IF_ERROR(params.ReadInt("nms_window", 1, kMax, &config.selector.nms_window));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("continuation", 0, kMax, &config.selector.continuation));
  RUBATO_RETURN_IF_ERROR(params.Finish());
  const Status valid = ValidateSfiPolicyConfig(config);
  if (!valid.ok()) return valid.WithContext(section.source + ": " + section.key_path);
  return config;
}

Status ValidateSfiPolicyConfig(const SfiPolicyConfig& config) {
  if (config.sink_tokens < 0) return FieldRangeError("sink_tokens", config.sink_tokens, "[0, inf)");
  if (config.recent_window < 1) {
    return FieldRangeError("recent_window", config.recent_window, "[1, inf)");
  }
  if (config.t_max < 1) return FieldRangeError("t_max", config.t_max, "[1, inf)");
  if (config.prefill_window < 1 || config.prefill_window > kSfiMaxPrefillWindow) {
    return FieldRangeError("prefill_window", config.prefill_window,
                           fmt::format("[1, {}]", kSfiMaxPrefillWindow));
  }
  if (!(config.confidence_threshold >= 0.0 && config.confidence_threshold < 1.0)) {
    return FieldRangeError("confidence_threshold", config.confidence_threshold, "[0, 1)");
  }
  if (!(config.fidelity_guard >= 0.0 && config.fidelity_guard <= 1.0)) {
    return FieldRangeError("fidelity_guard", config.fidelity_guard, "[0, 1]");
  }
  for (size_t i = 0; i < config.triggers.size(); ++i) {
    const std::string_view problem = TriggerProblem(config.triggers[i]);
    if (!problem.empty()) {
      return InvalidArgumentError(fmt::format("SfiPolicyConfig.triggers[{}] '{}' {}", i,
                                              Escaped(config.triggers[i]), problem));
    }
  }
  return ValidateSfiSelectorConfig(config.selector);
}

Result<std::vector<int>> ResolveTriggerTokens(const Tokenizer& tokenizer,
                                              std::span<const std::string> triggers) {
  for (const std::string& trigger : triggers) {
    const std::string_view problem = TriggerProblem(trigger);
    if (!problem.empty()) {
      return InvalidArgumentError(fmt::format("sfi trigger '{}': {}", Escaped(trigger), problem));
    }
  }
  std::vector<bool> matched(triggers.size(), false);
  std::vector<int> ids;  // ascending: ids are visited in order
  for (int id = 0; id < tokenizer.vocab_size(); ++id) {
    if (tokenizer.IsSpecialToken(id)) continue;
    const std::string text = TriggerText(tokenizer, id);
    if (text.empty()) continue;  // unknown id, or white space only
    bool is_trigger = false;
    for (size_t i = 0; i < triggers.size(); ++i) {
      if (text.ends_with(triggers[i])) {
        matched[i] = true;
        is_trigger = true;
      }
    }
    if (is_trigger) ids.push_back(id);
  }
  for (size_t i = 0; i < triggers.size(); ++i) {
    if (!matched[i]) {
      return InvalidArgumentError(fmt::format(
          "sfi trigger '{}': matches no token of the vocabulary (no non-special token's text, "
          "trailing spaces and tabs removed, ends with it)",
          Escaped(triggers[i])));
    }
  }
  return ids;
}

SfiSchedule::SfiSchedule(int t_max, const std::vector<int>* trigger_ids)
    : t_max_(t_max), trigger_ids_(trigger_ids) {
  assert(trigger_ids == nullptr || std::is_sorted(trigger_ids->begin(), trigger_ids->end()));
}

SfiStepKind SfiSchedule::NextStep() const {
  const bool slow = slow_steps_ == 0 || previous_is_trigger_ || redo_ || fast_since_slow_ >= t_max_;
  return slow ? SfiStepKind::kSlow : SfiStepKind::kFast;
}

void SfiSchedule::OnStep(SfiStepKind executed, int generated_token) {
  if (executed == SfiStepKind::kSlow) {
    ++slow_steps_;
    fast_since_slow_ = 0;
    redo_ = false;
  } else {
    ++fast_steps_;
    ++fast_since_slow_;
  }
  previous_is_trigger_ =
      trigger_ids_ != nullptr &&
      std::binary_search(trigger_ids_->begin(), trigger_ids_->end(), generated_token);
}

void SfiSchedule::OnFastStepDiscarded() {
  ++discarded_steps_;
  redo_ = true;
}

}  // namespace rubato
