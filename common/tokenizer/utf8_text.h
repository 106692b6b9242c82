// UTF-8 helpers for the tokenizer: validation with replacement exactly like Rust's
// String::from_utf8_lossy (which Hugging Face tokenizers uses when decoding), an incremental
// form of it for streaming output, and code point iteration.
//
// Replacement rule (Unicode "substitution of maximal subparts", as Rust does it): each maximal
// prefix of a would-be valid sequence that is cut short, and each byte that cannot start a
// sequence, becomes one U+FFFD. E.g. "\xE2\x82" + "A" -> "\uFFFDA", "\xFF\xFE" -> two U+FFFD.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace rubato {

inline constexpr std::string_view kUtf8ReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Appends `bytes` to `out` as valid UTF-8, replacing invalid parts with U+FFFD.
void AppendUtf8Lossy(std::string_view bytes, std::string* out);
std::string Utf8Lossy(std::string_view bytes);
bool IsValidUtf8(std::string_view bytes);

// Incremental AppendUtf8Lossy: Push() emits everything that is already decided and keeps back
// an incomplete sequence at the end (at most 3 bytes) until more bytes arrive; Finish() emits
// the held bytes (as U+FFFD, since they are incomplete). Pushing a byte string in any number of
// pieces and then calling Finish() gives exactly Utf8Lossy() of the whole.
class Utf8LossyStream {
 public:
  void Push(std::string_view bytes, std::string* out);
  void Finish(std::string* out);
  // Bytes held back waiting for the rest of a sequence.
  size_t pending_bytes() const { return pending_.size(); }

 private:
  std::string pending_;
};

// Length in bytes of the UTF-8 sequence starting with lead byte `lead` (1 for invalid leads).
// Meant for walking text that is already valid UTF-8.
inline size_t Utf8SequenceLength(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

// Decodes the code point at the start of valid UTF-8 `text` (non-empty).
char32_t DecodeUtf8CodePoint(std::string_view text);
void AppendUtf8CodePoint(char32_t code_point, std::string* out);

}  // namespace rubato
