// A compiled Unicode regular expression (PCRE2, UTF + UCP, JIT when available) that behaves like
// the Oniguruma regexes Hugging Face tokenizers uses for `Split` and `ByteLevel` pre-tokenizers.
//
// Oniguruma and PCRE2 agree on the constructs tokenizer patterns use (\p{L}, \p{N}, lookahead,
// (?i:...) with Unicode case folding, possessive/greedy quantifiers) except for `\s`: Oniguruma's
// \s is the Unicode White_Space property, PCRE2's (with UCP) also matches U+180E MONGOLIAN VOWEL
// SEPARATOR. Compile() therefore rewrites \s and \S to explicit White_Space sets (inside a
// character class, \S is left to PCRE2; no known tokenizer uses it there).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace rubato {

class UnicodeRegex {
 public:
  struct Match {
    size_t begin;  // byte offsets into the searched text
    size_t end;
  };

  // Compiles `pattern` (Oniguruma syntax as found in tokenizer.json). `literal` compiles it as a
  // plain string to find (the {"String": ...} form of a Split pattern). Errors name the pattern
  // and PCRE2's message with the offset.
  static Result<UnicodeRegex> Compile(std::string_view pattern, bool literal = false);

  // All non-overlapping matches, left to right. `text` must be valid UTF-8. After an empty match
  // the search resumes one code point later. Never fails: if PCRE2 gives up (resource limits on
  // pathological input), the rest of the text is reported without further matches and a warning
  // is logged.
  std::vector<Match> FindAll(std::string_view text) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct CodeDeleter {
    void operator()(void* code) const;
  };
  UnicodeRegex(std::string pattern, void* code) : pattern_(std::move(pattern)), code_(code) {}

  std::string pattern_;
  std::unique_ptr<void, CodeDeleter> code_;  // pcre2_code_8*
};

// Rewrites Oniguruma's \s / \S into PCRE2 sets with the same meaning (exposed for tests).
std::string TranslateOnigurumaWhitespace(std::string_view pattern);

}  // namespace rubato
