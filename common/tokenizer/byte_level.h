// The byte-level alphabet of GPT-2 style BPE ("bytes_to_unicode"): every byte 0..255 is shown as
// one printable code point, so that BPE vocabularies can be written as text. Printable bytes map
// to themselves ('!'..'~', '¡'..'¬', '®'..'ÿ'); the others map to U+0100.. in byte order, so
// the space 0x20 becomes 'Ġ' (U+0120) and '\n' becomes 'Ċ' (U+010A).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace rubato {

// Appends the byte-level form of `bytes` (each byte -> the UTF-8 of its code point).
void AppendByteLevel(std::string_view bytes, std::string* out);

// Reverses the mapping for one token: when every code point of `token` is a byte-level code
// point, appends the bytes and returns true; otherwise appends nothing and returns false (Hugging
// Face then uses the token's own UTF-8 bytes, e.g. for added tokens containing a plain space).
bool AppendBytesFromByteLevel(std::string_view token, std::string* out);

// The byte shown by `code_point`, if it is one of the 256 byte-level code points.
std::optional<uint8_t> ByteFromByteLevelCodePoint(char32_t code_point);

}  // namespace rubato
