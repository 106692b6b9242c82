// GPT-2 bytes_to_unicode tables and the two directions of the mapping.
#include "common/tokenizer/byte_level.h"

#include <array>

#include "common/tokenizer/utf8_text.h"

namespace rubato {

namespace {

struct ByteLevelTables {
  std::array<char32_t, 256> code_point_of_byte{};
  std::array<std::string, 256> utf8_of_byte;
  // Byte-level code points are all below U+0144; -1 for code points that are not in the map.
  std::array<int16_t, 0x144> byte_of_code_point{};

  ByteLevelTables() {
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    byte_of_code_point.fill(-1);
    char32_t next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      const char32_t cp = printable(b) ? static_cast<char32_t>(b) : next_extra++;
      code_point_of_byte[b] = cp;
      AppendUtf8CodePoint(cp, &utf8_of_byte[b]);
      byte_of_code_point[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTables& Tables() {
  static const ByteLevelTables tables;
  return tables;
}

}  // namespace

void AppendByteLevel(std::string_view bytes, std::string* out) {
  const ByteLevelTables& tables = Tables();
  for (const char c : bytes) out->append(tables.utf8_of_byte[static_cast<uint8_t>(c)]);
}

std::optional<uint8_t> ByteFromByteLevelCodePoint(char32_t code_point) {
  const ByteLevelTables& tables = Tables();
  if (code_point >= tables.byte_of_code_point.size()) return std::nullopt;
  const int16_t byte = tables.byte_of_code_point[code_point];
  if (byte < 0) return std::nullopt;
  return static_cast<uint8_t>(byte);
}

bool AppendBytesFromByteLevel(std::string_view token, std::string* out) {
  const size_t start_size = out->size();
  size_t pos = 0;
  while (pos < token.size()) {
    const size_t length = Utf8SequenceLength(static_cast<uint8_t>(token[pos]));
    const std::optional<uint8_t> byte =
        ByteFromByteLevelCodePoint(DecodeUtf8CodePoint(token.substr(pos)));
    if (!byte.has_value()) {
      out->resize(start_size);
      return false;
    }
    out->push_back(static_cast<char>(*byte));
    pos += length;
  }
  return true;
}

}  // namespace rubato
