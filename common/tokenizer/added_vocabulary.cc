// Added tokens: loading from tokenizer.json and leftmost-longest matching in text.
#include "common/tokenizer/added_vocabulary.h"

#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>

#include "common/tokenizer/utf8_text.h"

namespace rubato {

namespace {

bool IsWhiteSpace(char32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Rust regex \w: Alphabetic, M, Nd, Pc, Join_Control (approximated, see the header).
bool IsWordCharacter(char32_t cp) {
  if (cp == 0x200C || cp == 0x200D) return true;
  if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F189)) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// Start of the code point that ends at `end` (exclusive) in valid UTF-8 `text`.
size_t PreviousCodePointStart(std::string_view text, size_t end) {
  size_t pos = end - 1;
  while (pos > 0 && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) --pos;
  return pos;
}

bool EndsWithWord(std::string_view text, size_t end) {
  if (end == 0) return false;
  return IsWordCharacter(DecodeUtf8CodePoint(text.substr(PreviousCodePointStart(text, end))));
}

bool StartsWithWord(std::string_view text, size_t begin) {
  if (begin >= text.size()) return false;
  return IsWordCharacter(DecodeUtf8CodePoint(text.substr(begin)));
}

// Where the white space run that ends at `end` begins.
size_t WhiteSpaceRunStart(std::string_view text, size_t end) {
  while (end > 0) {
    const size_t start = PreviousCodePointStart(text, end);
    if (!IsWhiteSpace(DecodeUtf8CodePoint(text.substr(start)))) break;
    end = start;
  }
  return end;
}

// Where the white space run that starts at `begin` ends.
size_t WhiteSpaceRunEnd(std::string_view text, size_t begin) {
  while (begin < text.size() && IsWhiteSpace(DecodeUtf8CodePoint(text.substr(begin)))) {
    begin += Utf8SequenceLength(static_cast<uint8_t>(text[begin]));
  }
  return std::min(begin, text.size());
}

}  // namespace

void AddedVocabulary::BuildMatcher(Matcher* matcher) {
  for (size_t i = 0; i < matcher->tokens.size(); ++i) {
    const std::string& pattern = matcher->tokens[i].first;
    matcher->by_first_byte[static_cast<uint8_t>(pattern[0])].push_back(i);
  }
  for (auto& bucket : matcher->by_first_byte) {
    std::stable_sort(bucket.begin(), bucket.end(), [matcher](size_t a, size_t b) {
      return matcher->tokens[a].first.size() > matcher->tokens[b].first.size();
    });
  }
}

Result<AddedVocabulary> AddedVocabulary::FromJson(const nlohmann::json* added_tokens,
                                                  const JsonReader& reader,
                                                  const Normalizer& normalizer) {
  AddedVocabulary vocabulary;
  if (added_tokens == nullptr) return vocabulary;
  RUBATO_RETURN_IF_ERROR(reader.ExpectArray(*added_tokens, "added_tokens"));
  for (size_t i = 0; i < added_tokens->size(); ++i) {
    const nlohmann::json& entry = (*added_tokens)[i];
    const std::string path = JsonPathIndex("added_tokens", i);
    AddedToken token;
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* id, reader.Field(entry, "id", path));
    RUBATO_ASSIGN_OR_RETURN(token.id, reader.TokenId(*id, JsonPathJoin(path, "id")));
    RUBATO_ASSIGN_OR_RETURN(const nlohmann::json* content, reader.Field(entry, "content", path));
    RUBATO_ASSIGN_OR_RETURN(token.content, reader.String(*content, JsonPathJoin(path, "content")));
    RUBATO_ASSIGN_OR_RETURN(token.special, reader.OptionalBool(entry, "special", path, false));
    RUBATO_ASSIGN_OR_RETURN(token.single_word,
                            reader.OptionalBool(entry, "single_word", path, false));
    RUBATO_ASSIGN_OR_RETURN(token.lstrip, reader.OptionalBool(entry, "lstrip", path, false));
    RUBATO_ASSIGN_OR_RETURN(token.rstrip, reader.OptionalBool(entry, "rstrip", path, false));
    RUBATO_ASSIGN_OR_RETURN(token.normalized,
                            reader.OptionalBool(entry, "normalized", path, !token.special));
    if (token.content.empty()) {
      return reader.Error(StatusCode::kDataLoss, JsonPathJoin(path, "content"),
                          "an added token cannot be empty");
    }
    if (const auto it = vocabulary.id_of_content_.find(token.content);
        it != vocabulary.id_of_content_.end()) {
      return reader.Error(StatusCode::kDataLoss, path,
                          fmt::format("token '{}' is listed twice (ids {} and {})", token.content,
                                      it->second, token.id));
    }
    if (vocabulary.index_of_id_.contains(token.id)) {
      return reader.Error(StatusCode::kDataLoss, path,
                          fmt::format("token '{}' has id {}, which an earlier added token has",
                                      token.content, token.id));
    }
    vocabulary.id_of_content_.emplace(token.content, token.id);
    vocabulary.index_of_id_.emplace(token.id, vocabulary.tokens_.size());
    const size_t index = vocabulary.tokens_.size();
    if (token.normalized) {
      std::string pattern = normalizer.Apply(token.content);
      if (!pattern.empty()) vocabulary.normalized_matcher_.tokens.emplace_back(pattern, index);
    } else {
      vocabulary.raw_matcher_.tokens.emplace_back(token.content, index);
    }
    vocabulary.tokens_.push_back(std::move(token));
  }
  BuildMatcher(&vocabulary.raw_matcher_);
  BuildMatcher(&vocabulary.normalized_matcher_);
  return vocabulary;
}

std::optional<int> AddedVocabulary::IdOf(std::string_view content) const {
  const auto it = id_of_content_.find(content);
  if (it == id_of_content_.end()) return std::nullopt;
  return it->second;
}

const AddedToken* AddedVocabulary::FindById(int id) const {
  const auto it = index_of_id_.find(id);
  return it == index_of_id_.end() ? nullptr : &tokens_[it->second];
}

void AddedVocabulary::Split(const Matcher& matcher, std::string_view text,
                            std::vector<Segment>* segments) const {
  size_t text_start = 0;  // start of the plain text not yet emitted
  size_t pos = 0;
  while (pos < text.size()) {
    const auto& bucket = matcher.by_first_byte[static_cast<uint8_t>(text[pos])];
    const std::pair<std::string, size_t>* hit = nullptr;
    for (const size_t candidate : bucket) {
      const std::string& pattern = matcher.tokens[candidate].first;
      if (text.compare(pos, pattern.size(), pattern) == 0) {
        hit = &matcher.tokens[candidate];
        break;
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[hit->second];
    size_t begin = pos;
    size_t end = pos + hit->first.size();
    pos = end;
    if (token.single_word && (EndsWithWord(text, begin) || StartsWithWord(text, end))) continue;
    if (token.lstrip) begin = std::max(WhiteSpaceRunStart(text, begin), text_start);
    if (token.rstrip) end = WhiteSpaceRunEnd(text, end);
    if (begin > text_start) segments->push_back({text_start, begin, -1});
    segments->push_back({begin, end, token.id});
    text_start = end;
    pos = end;
  }
  if (text_start < text.size()) segments->push_back({text_start, text.size(), -1});
}

}  // namespace rubato
