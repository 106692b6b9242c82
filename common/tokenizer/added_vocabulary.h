// The `added_tokens` of tokenizer.json (special tokens such as <|im_start|>, and added
// non-special ones such as Qwen's <think>): found in the text before the model sees it, as HF
// AddedVocabulary does:
//   * tokens with normalized=false are matched in the raw text, the others in the normalized
//     text between those matches (their content normalized the same way);
//   * matching is leftmost-longest and non-overlapping (HF uses Aho-Corasick LeftmostLongest);
//   * single_word: a match touching a word character (\w) on either side is not a token;
//   * lstrip / rstrip: white space before / after the match becomes part of the token.
// Word characters and white space follow Rust's regex \w and \s (Unicode White_Space); \w is
// approximated from utf8proc categories (L, M, Nd, Nl, Pc, ZWJ/ZWNJ, circled/squared letters).
#pragma once

#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/json_reader.h"
#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/string_map.h"

namespace rubato {

struct AddedToken {
  std::string content;
  int id = 0;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
};

class AddedVocabulary {
 public:
  // `added_tokens` is the tokenizer.json "added_tokens" array (nullptr when absent).
  // `normalizer` turns the content of normalized=true tokens into what they match.
  static Result<AddedVocabulary> FromJson(const nlohmann::json* added_tokens,
                                          const JsonReader& reader, const Normalizer& normalizer);

  // A part of a text: either an added token (token_id >= 0) or plain text (token_id == -1).
  struct Segment {
    size_t begin;
    size_t end;
    int token_id;
  };
  // Splits raw text on the normalized=false tokens.
  void SplitRaw(std::string_view text, std::vector<Segment>* segments) const {
    Split(raw_matcher_, text, segments);
  }
  // Splits normalized text on the normalized=true tokens.
  void SplitNormalized(std::string_view text, std::vector<Segment>* segments) const {
    Split(normalized_matcher_, text, segments);
  }
  bool has_normalized_tokens() const { return !normalized_matcher_.tokens.empty(); }

  const std::vector<AddedToken>& tokens() const { return tokens_; }
  std::optional<int> IdOf(std::string_view content) const;
  // The added token with this id, or nullptr.
  const AddedToken* FindById(int id) const;

 private:
  // Patterns bucketed by first byte, longest first, so the first hit is the longest match.
  struct Matcher {
    std::vector<std::pair<std::string, size_t>> tokens;  // (pattern, index into tokens_)
    std::array<std::vector<size_t>, 256> by_first_byte;  // indices into `tokens`
  };
  static void BuildMatcher(Matcher* matcher);
  void Split(const Matcher& matcher, std::string_view text, std::vector<Segment>* segments) const;

  std::vector<AddedToken> tokens_;
  StringMap<int> id_of_content_;
  std::unordered_map<int, size_t> index_of_id_;  // id -> index into tokens_
  Matcher raw_matcher_;
  Matcher normalized_matcher_;
};

}  // namespace rubato
