// The SSE splitter and stream-chunk reader of `rubato bench serve`: a stream cut at every byte
// (and into single bytes) gives the events of the whole stream, CRLF / CR / LF line ends,
// comments and multi-line data, the event bound, and every unexpected JSON shape read as an
// error naming the field instead of an exception.
#include "inference_rank/cli/bench_serve_sse.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace rubato::bench {
namespace {

std::vector<std::string> Split(const std::vector<std::string_view>& pieces, size_t bound = 1024) {
  SseSplitter splitter(bound);
  std::vector<std::string> events;
  for (std::string_view piece : pieces) EXPECT_TRUE(splitter.Feed(piece, events));
  EXPECT_TRUE(splitter.Finish(events));
  return events;
}

TEST(BenchServeSseTest, EventsAreTheSameWhereverTheStreamIsCut) {
  const std::string stream =
      ": ping\r\n\r\n"
      "data: {\"choices\":[{\"text\":\"a\"}]}\r\n\r\n"
      "event: x\nid: 7\ndata:{\"choices\":[{\"text\":\"b\\n\"}]}\n\n"
      "data: one\rdata: two\r\r"
      "data: [DONE]\n\n";
  const std::vector<std::string> expected = {"{\"choices\":[{\"text\":\"a\"}]}",
                                             "{\"choices\":[{\"text\":\"b\\n\"}]}", "one\ntwo",
                                             "[DONE]"};
  ASSERT_EQ(Split({stream}), expected);
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    const std::string_view all(stream);
    EXPECT_EQ(Split({all.substr(0, cut), all.substr(cut)}), expected) << "cut at " << cut;
  }
  std::vector<std::string_view> bytes;
  for (size_t i = 0; i < stream.size(); ++i) bytes.push_back(std::string_view(stream).substr(i, 1));
  EXPECT_EQ(Split(bytes), expected);
}

TEST(BenchServeSseTest, AStreamClosedWithoutTheLastBlankLineStillEndsItsEvent) {
  EXPECT_EQ(Split({"data: [DONE]\n"}), std::vector<std::string>{"[DONE]"});
  EXPECT_EQ(Split({"data: [DONE]"}), std::vector<std::string>{"[DONE]"});
}

TEST(BenchServeSseTest, AnEventOverTheBoundIsAnErrorAndNothingMoreIsKept) {
  SseSplitter splitter(16);
  std::vector<std::string> events;
  EXPECT_TRUE(splitter.Feed("data: 0123456789\n\n", events));  // 16 bytes of lines
  EXPECT_FALSE(splitter.Feed("data: 01234567890", events));
  EXPECT_NE(splitter.error().find("longer than 16 bytes"), std::string::npos) << splitter.error();
  EXPECT_FALSE(splitter.Feed("\n\n", events));
  EXPECT_FALSE(splitter.Finish(events));
  EXPECT_EQ(events, std::vector<std::string>{"0123456789"});
}

TEST(BenchServeSseTest, CompletionAndChatChunksAreRead) {
  StreamEvent text = ReadStreamEvent(R"({"choices":[{"text":"hi"}]})", StreamApi::kCompletions);
  EXPECT_EQ(text.kind, StreamEvent::Kind::kChoice);
  EXPECT_EQ(text.text, "hi");
  StreamEvent empty = ReadStreamEvent(R"({"choices":[{"text":null}]})", StreamApi::kCompletions);
  EXPECT_EQ(empty.kind, StreamEvent::Kind::kChoice);
  StreamEvent chat =
      ReadStreamEvent(R"({"choices":[{"delta":{"content":"yo"}}]})", StreamApi::kChat);
  EXPECT_EQ(chat.kind, StreamEvent::Kind::kChoice);
  EXPECT_EQ(chat.text, "yo");
  StreamEvent usage = ReadStreamEvent(
      R"({"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":4}})", StreamApi::kChat);
  EXPECT_EQ(usage.kind, StreamEvent::Kind::kUsage);
  EXPECT_EQ(usage.prompt_tokens, 8);
  EXPECT_EQ(usage.completion_tokens, 4);
  EXPECT_EQ(ReadStreamEvent("[DONE]", StreamApi::kChat).kind, StreamEvent::Kind::kDone);
  EXPECT_EQ(ReadStreamEvent(R"({"id":"x"})", StreamApi::kChat).kind, StreamEvent::Kind::kIgnored);
}

TEST(BenchServeSseTest, UnexpectedShapesAreErrorsNamingTheField) {
  const struct {
    const char* data;
    StreamApi api;
    const char* error;
  } cases[] = {
      {R"({"choices":[{"text":5}]})", StreamApi::kCompletions, "choices[0].text is not a string"},
      {R"({"choices":[{"text":["a"]}]})", StreamApi::kCompletions, "choices[0].text"},
      {R"({"choices":"x"})", StreamApi::kCompletions, "choices is not an array"},
      {R"({"choices":[7]})", StreamApi::kCompletions, "choices[0] is not an object"},
      {R"({"choices":[{"delta":"x"}]})", StreamApi::kChat, "choices[0].delta is not an object"},
      {R"({"choices":[{"delta":{"content":{}}}]})", StreamApi::kChat, "delta.content"},
      {R"({"usage":-1})", StreamApi::kChat, "usage is not an object"},
      {R"({"usage":{"completion_tokens":-3}})", StreamApi::kChat, "usage.completion_tokens"},
      {R"({"usage":{"prompt_tokens":1e300}})", StreamApi::kChat, "usage.prompt_tokens"},
      {R"({"usage":{"prompt_tokens":18446744073709551615}})", StreamApi::kChat, "[0, 2^53]"},
      {"[1,2]", StreamApi::kChat, "not a JSON object"},
      {"null", StreamApi::kChat, "not a JSON object"},
      {"{\"choices\":", StreamApi::kChat, "not JSON"},
      {R"({"error":{"message":"overloaded"}})", StreamApi::kChat, "error event: overloaded"},
      {R"({"error":42})", StreamApi::kChat, "error event"},
  };
  for (const auto& c : cases) {
    const StreamEvent event = ReadStreamEvent(c.data, c.api);
    EXPECT_EQ(event.kind, StreamEvent::Kind::kError) << c.data;
    EXPECT_NE(event.error.find(c.error), std::string::npos) << c.data << " -> " << event.error;
  }
  const std::string long_text = "{\"choices\":[{\"text\":" + std::string(10000, '1') + "}]}";
  EXPECT_LT(ReadStreamEvent(long_text, StreamApi::kCompletions).error.size(), 200u);
}

}  // namespace
}  // namespace rubato::bench
