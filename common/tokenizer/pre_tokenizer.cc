// tokenizer.json pre-tokenizers: Split, ByteLevel, Sequence.
#include "common/tokenizer/pre_tokenizer.h"

#include <fmt/format.h>

#include "common/tokenizer/byte_level.h"

namespace rubato {

namespace {

struct Piece {
  size_t begin;
  size_t end;
  bool flag;  // "is a match" on input to ApplyBehavior, "remove" on output
};

Result<SplitBehavior> ParseBehavior(std::string_view name) {
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  return UnsupportedError(
      fmt::format("Split behavior '{}' is not known (expected Isolated, Removed, Contiguous, "
                  "MergedWithPrevious or MergedWithNext)",
                  name));
}

// HF NormalizedString::split: turns the (range, is_match) cover of a piece into
// (range, remove) pieces according to the behavior.
std::vector<Piece> ApplyBehavior(std::vector<Piece> matches, SplitBehavior behavior) {
  std::vector<Piece> out;
  out.reserve(matches.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (Piece& p : matches) out.push_back({p.begin, p.end, false});
      return out;
    case SplitBehavior::kRemoved:
      return matches;
    case SplitBehavior::kContiguous:
      for (const Piece& p : matches) {
        if (p.flag == previous_match && !out.empty()) {
          out.back().end = p.end;
        } else {
          out.push_back({p.begin, p.end, false});
        }
        previous_match = p.flag;
      }
      return out;
    case SplitBehavior::kMergedWithPrevious:
      for (const Piece& p : matches) {
        if (p.flag && !previous_match && !out.empty()) {
          out.back().end = p.end;
        } else {
          out.push_back({p.begin, p.end, false});
        }
        previous_match = p.flag;
      }
      return out;
    case SplitBehavior::kMergedWithNext:
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        if (it->flag && !previous_match && !out.empty()) {
          out.back().begin = it->begin;
        } else {
          out.push_back({it->begin, it->end, false});
        }
        previous_match = it->flag;
      }
      return std::vector<Piece>(out.rbegin(), out.rend());
  }
  return out;
}

}  // namespace

Result<PreTokenizer::SplitStep> PreTokenizer::ParseSplit(const nlohmann::json& spec,
                                                         const JsonReader& reader,
                                                         std::string_view path) {
  const std::string pattern_path = JsonPathJoin(path, "pattern");
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* pattern, reader.Field(spec, "pattern", path));
  RUBATO_RETURN_IF_ERROR(reader.ExpectObject(*pattern, pattern_path));
  const nlohmann::json* regex_text = reader.OptionalField(*pattern, "Regex");
  const nlohmann::json* literal_text = reader.OptionalField(*pattern, "String");
  if ((regex_text == nullptr) == (literal_text == nullptr)) {
    return reader.Error(StatusCode::kDataLoss, pattern_path,
                        "expected exactly one of {\"Regex\": ...} or {\"String\": ...}");
  }
  const bool literal = literal_text != nullptr;
  RUBATO_ASSIGN_OR_RETURN(std::string text,
                          reader.String(literal ? *literal_text : *regex_text,
                                        JsonPathJoin(pattern_path, literal ? "String" : "Regex")));
  Result<UnicodeRegex> regex = UnicodeRegex::Compile(text, literal);
  if (!regex.ok()) {
    return reader.Error(StatusCode::kDataLoss, pattern_path, regex.status().message());
  }

  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* behavior_field,
                          reader.Field(spec, "behavior", path));
  RUBATO_ASSIGN_OR_RETURN(std::string behavior_name,
                          reader.String(*behavior_field, JsonPathJoin(path, "behavior")));
  Result<SplitBehavior> behavior = ParseBehavior(behavior_name);
  if (!behavior.ok()) {
    return reader.Error(StatusCode::kUnsupported, JsonPathJoin(path, "behavior"),
                        behavior.status().message());
  }
  RUBATO_ASSIGN_OR_RETURN(bool invert, reader.OptionalBool(spec, "invert", path, false));
  return SplitStep{std::move(regex).value(), *behavior, invert};
}

Result<PreTokenizer::ByteLevelStep> PreTokenizer::ParseByteLevel(const nlohmann::json& spec,
                                                                 const JsonReader& reader,
                                                                 std::string_view path) {
  RUBATO_ASSIGN_OR_RETURN(bool add_prefix_space,
                          reader.OptionalBool(spec, "add_prefix_space", path, true));
  RUBATO_ASSIGN_OR_RETURN(bool use_regex, reader.OptionalBool(spec, "use_regex", path, true));
  ByteLevelStep step{add_prefix_space, std::nullopt};
  if (use_regex) {
    Result<UnicodeRegex> regex = UnicodeRegex::Compile(kGpt2SplitPattern);
    if (!regex.ok()) return regex.status().WithContext("compiling the GPT-2 split regex");
    step.gpt2_regex.emplace(std::move(regex).value());
  }
  return step;
}

Status PreTokenizer::AppendSteps(const nlohmann::json& spec, const JsonReader& reader,
                                 std::string_view path, std::vector<Step>* steps) {
  RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* type_field, reader.Field(spec, "type", path));
  RUBATO_ASSIGN_OR_RETURN(std::string type, reader.String(*type_field, JsonPathJoin(path, "type")));
  if (type == "Split") {
    RUBATO_ASSIGN_OR_RETURN(SplitStep step, ParseSplit(spec, reader, path));
    steps->emplace_back(std::move(step));
    return Status::Ok();
  }
  if (type == "ByteLevel") {
    RUBATO_ASSIGN_OR_RETURN(ByteLevelStep step, ParseByteLevel(spec, reader, path));
    steps->emplace_back(std::move(step));
    return Status::Ok();
  }
  if (type == "Sequence") {
    const std::string list_path = JsonPathJoin(path, "pretokenizers");
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* list, reader.Field(spec, "pretokenizers", path));
    RUBATO_RETURN_IF_ERROR(reader.ExpectArray(*list, list_path));
    for (size_t i = 0; i < list->size(); ++i) {
      RUBATO_RETURN_IF_ERROR(AppendSteps((*list)[i], reader, JsonPathIndex(list_path, i), steps));
    }
    return Status::Ok();
  }
  return reader.Error(StatusCode::kUnsupported, path,
                      fmt::format("pre_tokenizer type '{}' is not supported (rubato supports "
                                  "Split, ByteLevel and Sequence)",
                                  type));
}

Result<PreTokenizer> PreTokenizer::FromJson(const nlohmann::json* spec, const JsonReader& reader,
                                            std::string_view path) {
  PreTokenizer pre_tokenizer;
  if (spec == nullptr || spec->is_null()) return pre_tokenizer;
  RUBATO_RETURN_IF_ERROR(AppendSteps(*spec, reader, path, &pre_tokenizer.steps_));
  return pre_tokenizer;
}

void PreTokenizer::ApplySplit(const SplitStep& step, std::string_view piece,
                              std::vector<std::string>* out) {
  // The cover of `piece` by matches and the gaps between them (HF Pattern::find_matches).
  std::vector<Piece> cover;
  size_t previous_end = 0;
  for (const UnicodeRegex::Match& m : step.regex.FindAll(piece)) {
    if (m.begin != previous_end) cover.push_back({previous_end, m.begin, step.invert});
    cover.push_back({m.begin, m.end, !step.invert});
    previous_end = m.end;
  }
  if (previous_end != piece.size()) cover.push_back({previous_end, piece.size(), step.invert});

  for (const Piece& p : ApplyBehavior(std::move(cover), step.behavior)) {
    if (!p.flag && p.end > p.begin) out->emplace_back(piece.substr(p.begin, p.end - p.begin));
  }
}

void PreTokenizer::ApplyByteLevel(const ByteLevelStep& step, std::string_view piece,
                                  std::vector<std::string>* out) {
  std::string prefixed;
  if (step.add_prefix_space && !piece.starts_with(' ')) {
    prefixed.reserve(piece.size() + 1);
    prefixed.push_back(' ');
    prefixed.append(piece);
    piece = prefixed;
  }
  auto emit = [out](std::string_view part) {
    if (part.empty()) return;
    std::string mapped;
    mapped.reserve(part.size() * 2);
    AppendByteLevel(part, &mapped);
    out->push_back(std::move(mapped));
  };
  if (!step.gpt2_regex.has_value()) {
    emit(piece);
    return;
  }
  size_t previous_end = 0;
  for (const UnicodeRegex::Match& m : step.gpt2_regex->FindAll(piece)) {
    emit(piece.substr(previous_end, m.begin - previous_end));
    emit(piece.substr(m.begin, m.end - m.begin));
    previous_end = m.end;
  }
  emit(piece.substr(previous_end));
}

void PreTokenizer::Split(std::string_view text, std::vector<std::string>* words) const {
  if (text.empty()) return;
  std::vector<std::string> pieces{std::string(text)};
  std::vector<std::string> next;
  for (const Step& step : steps_) {
    next.clear();
    for (const std::string& piece : pieces) {
      if (const auto* split = std::get_if<SplitStep>(&step)) {
        ApplySplit(*split, piece, &next);
      } else {
        ApplyByteLevel(std::get<ByteLevelStep>(step), piece, &next);
      }
    }
    pieces.swap(next);
  }
  for (std::string& piece : pieces) words->push_back(std::move(piece));
}

}  // namespace rubato
