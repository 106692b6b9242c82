// UTF-8 repair (Rust from_utf8_lossy rules), its streaming form, and the byte-level alphabet.
#include "common/tokenizer/utf8_text.h"

#include <gtest/gtest.h>

#include <random>

#include "common/tokenizer/byte_level.h"

namespace rubato {
namespace {

const std::string kFffd(kUtf8ReplacementChar);

TEST(Utf8TextTest, ValidTextPassesThrough) {
  const std::string text = "aé中😀\u0000z";
  EXPECT_TRUE(IsValidUtf8(text));
  EXPECT_EQ(Utf8Lossy(text), text);
}

TEST(Utf8TextTest, ReplacesMaximalInvalidSubpartsLikeRust) {
  // A truncated 3-byte sequence followed by ASCII: one U+FFFD for the two bytes.
  EXPECT_EQ(Utf8Lossy("\xE2\x82"
                      "A"),
            kFffd + "A");
  // Bytes that never start a sequence: one each.
  EXPECT_EQ(Utf8Lossy("\xFF\xFE"), kFffd + kFffd);
  EXPECT_EQ(Utf8Lossy("\x80"
                      "a"),
            kFffd + "a");
  // Overlong encoding of '/': C0 is never valid, AF is a stray continuation.
  EXPECT_EQ(Utf8Lossy("\xC0\xAF"), kFffd + kFffd);
  // Surrogate U+D800: ED may only be followed by 80..9F.
  EXPECT_EQ(Utf8Lossy("\xED\xA0\x80"), kFffd + kFffd + kFffd);
  // Above U+10FFFF.
  EXPECT_EQ(Utf8Lossy("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);
  // Incomplete 4-byte sequence at the end: one U+FFFD for all three bytes.
  EXPECT_EQ(Utf8Lossy("x\xF0\x9F\x98"), "x" + kFffd);
  EXPECT_FALSE(IsValidUtf8("x\xF0\x9F\x98"));
}

TEST(Utf8TextTest, StreamHoldsBackIncompleteSequences) {
  Utf8LossyStream stream;
  std::string out;
  stream.Push("a\xF0\x9F", &out);
  EXPECT_EQ(out, "a");
  EXPECT_EQ(stream.pending_bytes(), 2u);
  stream.Push("\x98", &out);
  EXPECT_EQ(out, "a");
  stream.Push(
      "\x80"
      "b",
      &out);
  EXPECT_EQ(out,
            "a\xF0\x9F\x98\x80"
            "b");
  stream.Push("\xE4\xB8", &out);
  stream.Finish(&out);
  EXPECT_EQ(out, "a😀b" + kFffd);
  EXPECT_EQ(stream.pending_bytes(), 0u);
}

TEST(Utf8TextTest, StreamInAnyPiecesEqualsOneShot) {
  std::mt19937 rng(7);
  // Bytes biased towards UTF-8 lead and continuation bytes to hit every case.
  const std::string alphabet = "a \x80\xBF\x9F\xA0\xC2\xDF\xE0\xED\xEF\xF0\xF4\xF5\xFF\xC0\x8F\x90";
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bytes;
    const int length = static_cast<int>(rng() % 12);
    for (int i = 0; i < length; ++i) bytes.push_back(alphabet[rng() % alphabet.size()]);
    Utf8LossyStream stream;
    std::string streamed;
    for (size_t pos = 0; pos < bytes.size();) {
      const size_t piece = 1 + rng() % 3;
      stream.Push(std::string_view(bytes).substr(pos, piece), &streamed);
      pos += piece;
    }
    stream.Finish(&streamed);
    ASSERT_EQ(streamed, Utf8Lossy(bytes)) << "trial " << trial;
    ASSERT_TRUE(IsValidUtf8(streamed));
  }
}

TEST(ByteLevelTest, MapsEveryByteAndBack) {
  std::string shown;
  AppendByteLevel(std::string_view(" \n!\xFF\0", 5), &shown);
  // GPT-2: space -> U+0120, '\n' -> U+010A, '!' unchanged, 0xFF unchanged (ÿ), NUL -> U+0100.
  EXPECT_EQ(shown, std::string("Ġ") + "Ċ" + "!" + "ÿ" + "Ā");
  for (int b = 0; b < 256; ++b) {
    const std::string byte(1, static_cast<char>(b));
    std::string mapped, back;
    AppendByteLevel(byte, &mapped);
    ASSERT_TRUE(AppendBytesFromByteLevel(mapped, &back)) << b;
    ASSERT_EQ(back, byte);
  }
  // A token with a character outside the alphabet (a plain space) is not byte-level text.
  std::string out = "keep";
  EXPECT_FALSE(AppendBytesFromByteLevel("a b", &out));
  EXPECT_EQ(out, "keep");
}

}  // namespace
}  // namespace rubato
