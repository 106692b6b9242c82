// UTF-8 validation with Rust-compatible replacement, streaming variant, code point helpers.
#include "common/tokenizer/utf8_text.h"

#include <algorithm>

namespace rubato {

namespace {

enum class SequenceKind { kValid, kInvalid, kIncomplete };

struct SequenceCheck {
  SequenceKind kind;
  size_t length;  // kValid: sequence length; kInvalid: bytes replaced by one U+FFFD
};

// Classifies the sequence starting at bytes[0]. The accepted second-byte ranges are those of
// the Unicode standard (Table 3-7), which exclude overlong forms, surrogates and > U+10FFFF.
SequenceCheck CheckSequence(const uint8_t* bytes, size_t size) {
  const uint8_t lead = bytes[0];
  if (lead < 0x80) return {SequenceKind::kValid, 1};
  size_t length = 0;
  uint8_t second_min = 0x80, second_max = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_min = 0xA0;
    if (lead == 0xED) second_max = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_min = 0x90;
    if (lead == 0xF4) second_max = 0x8F;
  } else {
    return {SequenceKind::kInvalid, 1};  // continuation byte, C0, C1, F5..FF
  }
  for (size_t i = 1; i < length; ++i) {
    if (i >= size) return {SequenceKind::kIncomplete, i};
    const uint8_t lo = i == 1 ? second_min : 0x80;
    const uint8_t hi = i == 1 ? second_max : 0xBF;
    if (bytes[i] < lo || bytes[i] > hi) return {SequenceKind::kInvalid, i};
  }
  return {SequenceKind::kValid, length};
}

// Appends the decided part of `bytes`; returns how many bytes were consumed. With
// `final_chunk`, an incomplete tail is replaced and everything is consumed.
size_t AppendLossyPrefix(std::string_view bytes, bool final_chunk, std::string* out) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t pos = 0;
  while (pos < bytes.size()) {
    // Fast path for runs of ASCII.
    size_t run = pos;
    while (run < bytes.size() && data[run] < 0x80) ++run;
    if (run > pos) {
      out->append(bytes.substr(pos, run - pos));
      pos = run;
      continue;
    }
    const SequenceCheck check = CheckSequence(data + pos, bytes.size() - pos);
    switch (check.kind) {
      case SequenceKind::kValid:
        out->append(bytes.substr(pos, check.length));
        pos += check.length;
        break;
      case SequenceKind::kInvalid:
        out->append(kUtf8ReplacementChar);
        pos += check.length;
        break;
      case SequenceKind::kIncomplete:
        if (!final_chunk) return pos;
        out->append(kUtf8ReplacementChar);
        pos = bytes.size();
        break;
    }
  }
  return pos;
}

}  // namespace

void AppendUtf8Lossy(std::string_view bytes, std::string* out) {
  AppendLossyPrefix(bytes, /*final_chunk=*/true, out);
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  AppendUtf8Lossy(bytes, &out);
  return out;
}

bool IsValidUtf8(std::string_view bytes) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const SequenceCheck check = CheckSequence(data + pos, bytes.size() - pos);
    if (check.kind != SequenceKind::kValid) return false;
    pos += check.length;
  }
  return true;
}

void Utf8LossyStream::Push(std::string_view bytes, std::string* out) {
  pending_.append(bytes);
  const size_t consumed = AppendLossyPrefix(pending_, /*final_chunk=*/false, out);
  pending_.erase(0, consumed);
}

void Utf8LossyStream::Finish(std::string* out) {
  AppendUtf8Lossy(pending_, out);
  pending_.clear();
}

char32_t DecodeUtf8CodePoint(std::string_view text) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t length = std::min(Utf8SequenceLength(s[0]), text.size());
  switch (length) {
    case 1:
      return s[0];
    case 2:
      return (char32_t(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    case 3:
      return (char32_t(s[0] & 0x0F) << 12) | (char32_t(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    default:
      return (char32_t(s[0] & 0x07) << 18) | (char32_t(s[1] & 0x3F) << 12) |
             (char32_t(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
  }
}

void AppendUtf8CodePoint(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace rubato
