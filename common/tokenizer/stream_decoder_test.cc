// StreamDecoder: text appears only when complete, and the pieces add up to Decode.
#include "common/tokenizer/stream_decoder.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace rubato {
namespace {

std::unique_ptr<Tokenizer> LoadTiny() {
  Result<std::unique_ptr<Tokenizer>> loaded =
      Tokenizer::LoadFromDirectory("tests/data/tokenizer/tiny_bpe");
  EXPECT_TRUE(loaded.ok()) << loaded.status().ToString();
  return loaded.ok() ? std::move(loaded).value() : nullptr;
}

TEST(StreamDecoderTest, HoldsBackSplitCharacters) {
  std::unique_ptr<Tokenizer> tokenizer = LoadTiny();
  ASSERT_NE(tokenizer, nullptr);
  // The tiny vocabulary has no merges for the emoji: four byte tokens.
  const std::vector<int> ids = tokenizer->Encode("a😀");
  ASSERT_EQ(ids.size(), 5u);
  StreamDecoder stream(*tokenizer);
  EXPECT_EQ(stream.Push(ids[0]), "a");
  EXPECT_EQ(stream.Push(ids[1]), "");
  EXPECT_EQ(stream.Push(ids[2]), "");
  EXPECT_EQ(stream.Push(ids[3]), "");
  EXPECT_EQ(stream.Push(ids[4]), "😀");
  EXPECT_EQ(stream.Flush(), "");
}

TEST(StreamDecoderTest, FlushReplacesAnUnfinishedTail) {
  std::unique_ptr<Tokenizer> tokenizer = LoadTiny();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<int> ids = tokenizer->Encode("中");  // E4 B8 AD
  ASSERT_EQ(ids.size(), 3u);
  StreamDecoder stream(*tokenizer);
  EXPECT_EQ(stream.Push(ids[0]), "");
  EXPECT_EQ(stream.Push(ids[1]), "");
  EXPECT_EQ(stream.Flush(), "\uFFFD");
  // A token that cannot continue the sequence releases it as U+FFFD at once.
  EXPECT_EQ(stream.Push(ids[0]), "");
  EXPECT_EQ(stream.Push(*tokenizer->TokenToId("a")), "\uFFFDa");
}

TEST(StreamDecoderTest, ConcatenationEqualsDecode) {
  std::unique_ptr<Tokenizer> tokenizer = LoadTiny();
  ASSERT_NE(tokenizer, nullptr);
  const std::string text = "<bos>héllo 👨‍👩‍👧 the<|endoftext|>世界\r\n€";
  const std::vector<int> ids = tokenizer->Encode(text);
  for (const bool skip : {false, true}) {
    StreamDecoder stream(*tokenizer, skip);
    std::string streamed;
    for (const int id : ids) streamed += stream.Push(id);
    streamed += stream.Flush();
    EXPECT_EQ(streamed, tokenizer->Decode(ids, skip));
  }
  StreamDecoder stream(*tokenizer, /*skip_special_tokens=*/true);
  EXPECT_EQ(stream.Push(*tokenizer->TokenToId("<|endoftext|>")), "");
  EXPECT_EQ(stream.Push(-1), "");
}

}  // namespace
}  // namespace rubato
