// PCRE2 wrapper for tokenizer pre-tokenization patterns.
#include "common/tokenizer/unicode_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include "common/logging.h"
#include "common/tokenizer/utf8_text.h"

namespace rubato {

namespace {

// Unicode White_Space (Oniguruma's \s, Rust's char::is_whitespace), as class contents.
constexpr std::string_view kWhiteSpaceSet =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";

pcre2_code* Code(void* code) { return static_cast<pcre2_code*>(code); }

std::string Pcre2ErrorMessage(int error_code) {
  PCRE2_UCHAR buffer[256];
  const int length = pcre2_get_error_message(error_code, buffer, sizeof(buffer));
  if (length < 0) return fmt::format("PCRE2 error {}", error_code);
  return std::string(reinterpret_cast<const char*>(buffer), static_cast<size_t>(length));
}

}  // namespace

std::string TranslateOnigurumaWhitespace(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  size_t class_body_start = 0;  // position right after "[" or "[^"
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      ++i;
      if (next == 's') {
        if (in_class) {
          out.append(kWhiteSpaceSet);
        } else {
          out.append("[").append(kWhiteSpaceSet).append("]");
        }
      } else if (next == 'S' && !in_class) {
        out.append("[^").append(kWhiteSpaceSet).append("]");
      } else {
        out.push_back(c);
        out.push_back(next);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      class_body_start = i + 1;
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
        // POSIX class such as [:alpha:]: copy through its closing ":]".
        const size_t close = pattern.find(":]", i + 2);
        if (close != std::string_view::npos) {
          out.append(pattern.substr(i, close + 2 - i));
          i = close + 1;
          continue;
        }
      }
      if (c == ']' && i != class_body_start) in_class = false;
    }
    out.push_back(c);
  }
  return out;
}

void UnicodeRegex::CodeDeleter::operator()(void* code) const { pcre2_code_free(Code(code)); }

Result<UnicodeRegex> UnicodeRegex::Compile(std::string_view pattern, bool literal) {
  const std::string translated =
      literal ? std::string(pattern) : TranslateOnigurumaWhitespace(pattern);
  // PCRE2_LITERAL admits only a few other options, and UCP means nothing for a literal.
  const uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()),
                                   translated.size(), options, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    return InvalidArgumentError(fmt::format("regex '{}' does not compile (PCRE2, at offset {}): {}",
                                            pattern, error_offset, Pcre2ErrorMessage(error_code)));
  }
  // JIT is an optimisation only: when unavailable, pcre2_match interprets the pattern.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return UnicodeRegex(std::string(pattern), code);
}

std::vector<UnicodeRegex::Match> UnicodeRegex::FindAll(std::string_view text) const {
  std::vector<Match> matches;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match_data(
      pcre2_match_data_create_from_pattern(Code(code_.get()), nullptr), &pcre2_match_data_free);
  if (match_data == nullptr) {
    RUBATO_LOG_WARN("tokenizer", "regex '{}': out of memory for match data", pattern_);
    return matches;
  }
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t offset = 0;
  while (offset <= text.size()) {
    int rc = pcre2_match(Code(code_.get()), subject, text.size(), offset, PCRE2_NO_UTF_CHECK,
                         match_data.get(), nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The JIT stack is small; the interpreter keeps its backtracking state on the heap.
      rc = pcre2_match(Code(code_.get()), subject, text.size(), offset,
                       PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, match_data.get(), nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      RUBATO_LOG_WARN("tokenizer", "regex '{}' gave up at byte {} of a {}-byte text: {}", pattern_,
                      offset, text.size(), Pcre2ErrorMessage(rc));
      break;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data.get());
    const size_t begin = ovector[0];
    const size_t end = ovector[1];
    if (begin == end) {
      // Empty match: keep it unless it touches the previous match, then step one code point.
      if (matches.empty() || matches.back().end != begin) {
        matches.push_back({begin, end});
      }
      if (end >= text.size()) break;
      offset = end + Utf8SequenceLength(static_cast<uint8_t>(text[end]));
      continue;
    }
    matches.push_back({begin, end});
    offset = end;
  }
  return matches;
}

}  // namespace rubato
