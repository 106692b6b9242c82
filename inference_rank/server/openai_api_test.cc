// Tests for the OpenAI wire format of `rubato serve`: every request field parsed, every error
// naming its field, the response / chunk / model-list JSON shapes, and SSE framing.
#include "inference_rank/server/openai_api.h"

#include <gtest/gtest.h>

#include <cmath>

#include <string>
#include <utility>
#include <vector>

namespace rubato::server {
namespace {

using nlohmann::json;

CompletionRequest ParseOk(const std::string& body, CompletionKind kind = CompletionKind::kText) {
  CompletionRequest request;
  const std::optional<ApiError> error = ParseCompletionRequest(body, kind, request);
  EXPECT_FALSE(error.has_value()) << body << " -> " << (error ? error->message : "");
  return request;
}

ApiError ParseError(const std::string& body, CompletionKind kind = CompletionKind::kText) {
  CompletionRequest request;
  const std::optional<ApiError> error = ParseCompletionRequest(body, kind, request);
  EXPECT_TRUE(error.has_value()) << body << " was accepted";
  return error.value_or(ApiError{});
}

// Hostile bodies: nesting past the bound is refused before parsing (100k levels overflowed the
// stack), and no message echoes more than a short prefix of what was sent.
TEST(OpenAiApiTest, DeepBodiesAndHugeValuesAreRefusedBriefly) {
  const std::string deep =
      "{\"messages\": [{\"role\": " + std::string(100000, '[') + std::string(100000, ']') + "}]}";
  const ApiError nested = ParseError(deep, CompletionKind::kChat);
  EXPECT_NE(nested.message.find("nested deeper than"), std::string::npos) << nested.message;
  const std::string huge_role =
      "{\"messages\": [{\"role\": \"" + std::string(1 << 20, 'x') + "\", \"content\": \"hi\"}]}";
  const ApiError role = ParseError(huge_role, CompletionKind::kChat);
  EXPECT_LT(role.message.size(), 300u) << role.message.substr(0, 300);
  EXPECT_NE(role.message.find("bytes)"), std::string::npos) << role.message.substr(0, 300);
}

// Field names are the client's too: a 1 MB name in any place rubato refuses one by name comes
// back as a short excerpt, in the message and in `param` (tests/fuzz/openai_request_fuzzer
// checks the same bound on every error).
TEST(OpenAiApiTest, HugeFieldNamesAreEchoedBriefly) {
  const std::string name = std::string(1 << 20, 'k');
  const std::pair<std::string, CompletionKind> bodies[] = {
      {R"({"prompt": "x", ")" + name + R"(": 1})", CompletionKind::kText},
      {R"({"messages": [{"role": "user", "content": "x", ")" + name + R"(": 1}]})",
       CompletionKind::kChat},
      {R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", ")" + name +
           R"(": 1}]}]})",
       CompletionKind::kChat},
      {R"({"prompt": "x", "logit_bias": {")" + name + R"(": 1}})", CompletionKind::kText},
      {R"({"prompt": "x", "stream_options": {")" + name + R"(": true}})", CompletionKind::kText},
  };
  for (const auto& [body, kind] : bodies) {
    const ApiError error = ParseError(body, kind);
    EXPECT_LT(error.message.size(), 300u) << error.message.substr(0, 300);
    EXPECT_LT(error.param.size(), 100u) << error.param.substr(0, 300);
    EXPECT_NE(error.message.find("kkkk... (1048576 bytes)"), std::string::npos)
        << error.message.substr(0, 300);
  }
}

TEST(OpenAiApiTest, CompletionDefaults) {
  const CompletionRequest request = ParseOk(R"({"prompt": "hello"})");
  EXPECT_EQ(request.prompt_text, "hello");
  EXPECT_TRUE(request.prompt_ids.empty());
  EXPECT_FALSE(request.model.has_value());
  EXPECT_FALSE(request.max_tokens.has_value());  // the router uses 16 for completions
  EXPECT_EQ(request.temperature, 1.f);
  EXPECT_EQ(request.top_p, 1.f);
  EXPECT_EQ(request.top_k, 0);
  EXPECT_FALSE(request.seed.has_value());
  EXPECT_TRUE(request.stop.empty());
  EXPECT_FALSE(request.stream);
  EXPECT_FALSE(request.include_usage);
}

TEST(OpenAiApiTest, CompletionEveryField) {
  const CompletionRequest request = ParseOk(
      R"({"model": "m", "prompt": ["one string"], "max_tokens": 7, "temperature": 0.5,
          "top_p": 0.9, "top_k": 40, "seed": 1234, "stop": ["\n", "END"], "stream": true,
          "stream_options": {"include_usage": true}, "n": 1, "user": "ignored",
          "presence_penalty": 0})");
  EXPECT_EQ(request.model, "m");
  EXPECT_EQ(request.prompt_text, "one string");
  EXPECT_EQ(request.max_tokens, 7);
  EXPECT_FLOAT_EQ(request.temperature, 0.5f);
  EXPECT_FLOAT_EQ(request.top_p, 0.9f);
  EXPECT_EQ(request.top_k, 40);
  EXPECT_EQ(request.seed, 1234u);
  EXPECT_EQ(request.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_TRUE(request.stream);
  EXPECT_TRUE(request.include_usage);
}

// Stop lists are bounded (a request with 1.2 M stop strings made every other client 9x slower:
// each token's text is matched against every one): at most 64 strings of 16 KiB together,
// refused by name before they are copied.
TEST(OpenAiApiTest, StopListsAreBounded) {
  std::string many = R"({"prompt": "hi", "stop": [)";
  for (int i = 0; i < 1200000; ++i) many += i == 0 ? "\"s\"" : ",\"s\"";
  many += "]}";
  const ApiError count = ParseError(many);
  EXPECT_EQ(count.param, "stop");
  EXPECT_NE(count.message.find("'stop' holds 1200000 strings; at most 64"), std::string::npos)
      << count.message;
  const ApiError bytes =
      ParseError(R"({"prompt": "hi", "stop": [")" + std::string(10000, 'a') + R"(", ")" +
                 std::string(10000, 'b') + R"("]})");
  EXPECT_EQ(bytes.param, "stop");
  EXPECT_NE(bytes.message.find("more than 16384 bytes together"), std::string::npos)
      << bytes.message;
  const CompletionRequest fine = ParseOk(R"({"prompt": "hi", "stop": [")" +
                                         std::string(8000, 'a') + R"(", "b", "c"]})");
  EXPECT_EQ(fine.stop.size(), 3u);
}

TEST(OpenAiApiTest, PromptAsTokenIdsAndStopAsString) {
  const CompletionRequest request = ParseOk(R"({"prompt": [1, 2, 300], "stop": "x", "top_k": -1})");
  EXPECT_FALSE(request.prompt_text.has_value());
  EXPECT_EQ(request.prompt_ids, (std::vector<int>{1, 2, 300}));
  EXPECT_EQ(request.stop, (std::vector<std::string>{"x"}));
  EXPECT_EQ(request.top_k, 0);  // -1: off, as vLLM
}

TEST(OpenAiApiTest, ChatMessagesAndMaxCompletionTokens) {
  const CompletionRequest request = ParseOk(
      R"({"messages": [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                    {"type": "text", "text": "there"}]},
                       {"role": "developer", "content": "d"},
                       {"role": "assistant", "content": "a", "refusal": null}],
          "max_completion_tokens": 3})",
      CompletionKind::kChat);
  ASSERT_EQ(request.messages.size(), 4u);  // a null field (the SDKs' refusal) is absent
  EXPECT_EQ(request.messages[0].role, "system");
  EXPECT_EQ(request.messages[0].content, "be brief");
  EXPECT_EQ(request.messages[1].content, "hi there");
  EXPECT_EQ(request.messages[2].role, "system");
  EXPECT_EQ(request.max_tokens, 3);
}

TEST(OpenAiApiTest, MaxCompletionTokensWinsAndPenaltiesParse) {
  const CompletionRequest chat = ParseOk(
      R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
          "max_completion_tokens": 4, "presence_penalty": -1.5, "frequency_penalty": 2,
          "logit_bias": {"17": -100, "3": 2.5}, "tools": null})",
      CompletionKind::kChat);
  EXPECT_EQ(chat.max_tokens, 4);
  EXPECT_FLOAT_EQ(chat.presence_penalty, -1.5f);
  EXPECT_FLOAT_EQ(chat.frequency_penalty, 2.f);
  EXPECT_EQ(chat.logit_bias, (std::vector<std::pair<int, float>>{{3, 2.5f}, {17, -100.f}}));
  EXPECT_EQ(ParseOk(R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9})",
                    CompletionKind::kChat)
                .max_tokens,
            9);
}

struct BadCase {
  const char* body;
  const char* param;     // the field the error must name ("" for the whole body)
  const char* mentions;  // a piece of the message
};

TEST(OpenAiApiTest, EveryCompletionErrorNamesItsField) {
  const BadCase cases[] = {
      {"{not json", "", "not valid JSON"},
      {"[1, 2]", "", "must be a JSON object"},
      {"{}", "prompt", "required"},
      {R"({"prompt": 5})", "prompt", "got the integer 5"},
      {R"({"prompt": ["a", "b"]})", "prompt", "one prompt per request"},
      {R"({"prompt": [1, -2]})", "prompt", "token 1"},
      {R"({"prompt": [1, 2.5]})", "prompt", "token 1"},
      {R"({"prompt": {}})", "prompt", "an object"},
      {R"({"prompt": "x", "model": 3})", "model", "must be a string"},
      {R"({"prompt": "x", "max_tokens": 0})", "max_tokens", "got 0"},
      {R"({"prompt": "x", "max_tokens": "5"})", "max_tokens", "a string"},
      {R"({"prompt": "x", "max_tokens": 1.5})", "max_tokens", "integer"},
      {R"({"prompt": "x", "max_tokens": 99999999999999999999})", "max_tokens", "integer"},
      {R"({"prompt": "x", "temperature": -0.1})", "temperature", "-0.1"},
      {R"({"prompt": "x", "temperature": "hot"})", "temperature", "a string"},
      {R"({"prompt": "x", "top_p": 0})", "top_p", "(0, 1]"},
      {R"({"prompt": "x", "top_p": 1.5})", "top_p", "1.5"},
      {R"({"prompt": "x", "top_k": -2})", "top_k", "got -2"},
      {R"({"prompt": "x", "seed": "s"})", "seed", "a string"},
      {R"({"prompt": "x", "stop": 3})", "stop", "string or an array"},
      {R"({"prompt": "x", "stop": ["a", ""]})", "stop", "item 1"},
      {R"({"prompt": "x", "stop": [null]})", "stop", "item 0"},
      {R"({"prompt": "x", "stream": "yes"})", "stream", "true or false"},
      {R"({"prompt": "x", "stream_options": 1})", "stream_options", "object"},
      {R"({"prompt": "x", "stream_options": {"include_usage": 1}})", "stream_options.include_usage",
       "true or false"},
      {R"({"prompt": "x", "n": 2})", "n", "one choice"},
      {R"({"prompt": "x", "best_of": 3})", "best_of", "got 3"},
      {R"({"prompt": "x", "echo": true})", "echo", "not supported"},
      {R"({"prompt": "x", "logprobs": 21})", "logprobs", "[0, 20]"},
      {R"({"prompt": "x", "logprobs": true})", "logprobs", "integer"},
      {R"({"prompt": "x", "repetition_penalty": 0})", "repetition_penalty", "(0, 2]"},
      {R"({"prompt": "x", "repetition_penalty": 2.5})", "repetition_penalty", "2.5"},
      {R"({"prompt": "x", "ignore_eos": 1})", "ignore_eos", "true or false"},
      {R"({"prompt": "x", "response_format": {"type": "json_object"}})", "response_format.type",
       "not supported"},
      {R"({"prompt": "x", "suffix": "y"})", "suffix", "not supported"},
      {R"({"prompt": "x", "tools": []})", "tools", "not supported"},
      {R"({"prompt": "x", "max_completion_tokens": 3})", "max_completion_tokens", "not supported"},
      {R"({"prompt": "x", "stream_options": {"x": 1}})", "stream_options.x", "not supported"},
      {R"({"prompt": "x", "frequency_penalty": 2.5})", "frequency_penalty", "[-2, 2]"},
      {R"({"prompt": "x", "presence_penalty": "a"})", "presence_penalty", "a string"},
      {R"({"prompt": "x", "logit_bias": [1]})", "logit_bias", "an object"},
      {R"({"prompt": "x", "logit_bias": {"-1": 1}})", "logit_bias", "token id"},
      {R"({"prompt": "x", "logit_bias": {"3": 101}})", "logit_bias", "[-100, 100]"},
      {R"({"prompt": "x", "logit_bias": {"3": 1, "03": 2}})", "logit_bias", "twice"},
      {R"({"prompt": "x", "user": 5})", "user", "must be a string"},
  };
  for (const BadCase& bad : cases) {
    const ApiError error = ParseError(bad.body);
    EXPECT_EQ(error.http_status, 400) << bad.body;
    EXPECT_EQ(error.type, "invalid_request_error") << bad.body;
    EXPECT_EQ(error.param, bad.param) << bad.body << " -> " << error.message;
    EXPECT_NE(error.message.find(bad.mentions), std::string::npos)
        << bad.body << " -> " << error.message;
  }
}

TEST(OpenAiApiTest, EveryChatErrorNamesItsField) {
  const BadCase cases[] = {
      {R"({"prompt": "x"})", "messages", "non-empty array"},
      {R"({"messages": []})", "messages", "non-empty array"},
      {R"({"messages": ["hi"]})", "messages[0]", "must be an object"},
      {R"({"messages": [{"role": "robot", "content": "x"}]})", "messages[0].role", "robot"},
      {R"({"messages": [{"content": "x"}]})", "messages[0].role", "null"},
      {R"({"messages": [{"role": "user", "content": 1}]})", "messages[0].content", "integer"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages[0].content", "text"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})",
       "max_completion_tokens", "got 0"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs",
       "needs 'logprobs': true"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true,
           "top_logprobs": 21})", "top_logprobs", "[0, 20]"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})", "logprobs",
       "true or false"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {}})",
       "response_format", "\"text\""},
      {R"({"messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "json_schema", "json_schema": {}}})",
       "response_format.type", "json_schema"},
      {R"({"messages": [{"role": "user", "content": "x"}], "echo": true})", "echo",
       "not supported"},
      // Inside a message: only role and content; inside a content part: only type and text.
      {R"({"messages": [{"role": "user", "content": "x", "name": 5}]})", "messages[0].name",
       "must be a string"},
      {R"({"messages": [{"role": "user", "content": "x"},
                        {"role": "assistant", "content": null, "tool_calls": []}]})",
       "messages[1].tool_calls", "only role, content and name"},
      {R"({"messages": [{"role": "tool", "content": "4", "tool_call_id": "c1"}]})",
       "messages[0].tool_call_id", "not supported"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                      "cache_control": {}}]}]})",
       "messages[0].content", "content[0].cache_control"},
  };
  for (const BadCase& bad : cases) {
    const ApiError error = ParseError(bad.body, CompletionKind::kChat);
    EXPECT_EQ(error.param, bad.param) << bad.body << " -> " << error.message;
    EXPECT_NE(error.message.find(bad.mentions), std::string::npos)
        << bad.body << " -> " << error.message;
  }
}

// What vLLM's and OpenAI's clients send as no-ops, and the fields rubato implements beyond
// OpenAI's (vLLM's repetition_penalty, ignore_eos), parse into the request.
TEST(OpenAiApiTest, ClientNoOpsAndVllmExtensionsAreAccepted) {
  CompletionRequest request;
  ASSERT_EQ(ParseCompletionRequest(R"({"prompt": "x", "repetition_penalty": 1.0, "logprobs": null,
      "ignore_eos": true, "response_format": {"type": "text"}})",
                                   CompletionKind::kText, request),
            std::nullopt);
  EXPECT_EQ(request.repetition_penalty, 1.f);
  EXPECT_TRUE(request.ignore_eos);
  EXPECT_EQ(request.logprobs, -1);
  ASSERT_EQ(ParseCompletionRequest(R"({"prompt": "x", "logprobs": 0, "repetition_penalty": 1.3})",
                                   CompletionKind::kText, request),
            std::nullopt);
  EXPECT_EQ(request.logprobs, 0);
  EXPECT_FLOAT_EQ(request.repetition_penalty, 1.3f);
  ASSERT_EQ(ParseCompletionRequest(
                R"({"messages": [{"role": "user", "name": "ann", "content": "x"}],
                    "logprobs": true, "top_logprobs": 4})",
                CompletionKind::kChat, request),
            std::nullopt);
  EXPECT_EQ(request.logprobs, 4);
  EXPECT_EQ(request.messages.at(0).content, "x");
  ASSERT_EQ(ParseCompletionRequest(R"({"messages": [{"role": "user", "content": "x"}],
                                       "logprobs": true})",
                                   CompletionKind::kChat, request),
            std::nullopt);
  EXPECT_EQ(request.logprobs, 0);
  ASSERT_EQ(ParseCompletionRequest(R"({"messages": [{"role": "user", "content": "x"}],
                                       "logprobs": false})",
                                   CompletionKind::kChat, request),
            std::nullopt);
  EXPECT_EQ(request.logprobs, -1);
}

TEST(OpenAiApiTest, LogprobsJsonShapes) {
  const std::vector<TokenLogprobText> tokens = {
      {"He", -0.5f, {{"He", -0.5f}, {"She", -1.5f}}},
      {"llo", -2.f, {{"y", -1.f}, {"llo", -2.f}}},
      {"!", -INFINITY, {}}};
  size_t offset = 10;
  const json text = CompletionLogprobsJson(tokens, offset);
  EXPECT_EQ(text["tokens"], json({"He", "llo", "!"}));
  EXPECT_EQ(text["token_logprobs"][1], -2.f);
  EXPECT_EQ(text["token_logprobs"][2], -9999.f);  // JSON has no -inf
  EXPECT_EQ(text["top_logprobs"][0], json({{"He", -0.5f}, {"She", -1.5f}}));
  EXPECT_EQ(text["top_logprobs"][2], json({{"!", -9999.f}}));  // the sampled token joins
  EXPECT_EQ(text["text_offset"], json({10, 12, 15}));
  EXPECT_EQ(offset, 16u);
  const json chat = ChatLogprobsJson(tokens);
  ASSERT_EQ(chat["content"].size(), 3u);
  EXPECT_EQ(chat["content"][0]["token"], "He");
  EXPECT_EQ(chat["content"][0]["bytes"], json({72, 101}));
  EXPECT_EQ(chat["content"][1]["top_logprobs"][0], json({{"token", "y"}, {"logprob", -1.f},
                                                         {"bytes", {121}}}));
  EXPECT_TRUE(chat["content"][2]["top_logprobs"].empty());
}

TEST(OpenAiApiTest, ErrorBodyShape) {
  const json body = json::parse(
      ApiErrorBody({404, "no such model", "invalid_request_error", "model", "model_not_found"}));
  EXPECT_EQ(body["error"]["message"], "no such model");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_EQ(body["error"]["param"], "model");
  EXPECT_EQ(body["error"]["code"], "model_not_found");
  const json unnamed = json::parse(ApiErrorBody({400, "bad", "invalid_request_error", "", ""}));
  EXPECT_TRUE(unnamed["error"]["param"].is_null());
  EXPECT_TRUE(unnamed["error"]["code"].is_null());
}

CompletionResult SampleResult() {
  CompletionResult result;
  result.id = "cmpl-1";
  result.created = 1700000000;
  result.model = "tiny";
  result.text = "hello";
  result.finish_reason = "length";
  result.prompt_tokens = 3;
  result.completion_tokens = 4;
  return result;
}

TEST(OpenAiApiTest, CompletionResponseShape) {
  const json text = CompletionResponseJson(CompletionKind::kText, SampleResult());
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["id"], "cmpl-1");
  EXPECT_EQ(text["created"], 1700000000);
  EXPECT_EQ(text["model"], "tiny");
  ASSERT_EQ(text["choices"].size(), 1u);
  EXPECT_EQ(text["choices"][0]["text"], "hello");
  EXPECT_EQ(text["choices"][0]["index"], 0);
  EXPECT_EQ(text["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(text["usage"],
            json({{"prompt_tokens", 3}, {"completion_tokens", 4}, {"total_tokens", 7}}));
  const json chat = CompletionResponseJson(CompletionKind::kChat, SampleResult());
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"], json({{"role", "assistant"}, {"content", "hello"}}));
}

TEST(OpenAiApiTest, ChunkShapes) {
  const CompletionResult head = SampleResult();
  const json text = CompletionChunkJson(CompletionKind::kText, head, "he", "", false);
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "he");
  EXPECT_TRUE(text["choices"][0]["finish_reason"].is_null());
  const json first = CompletionChunkJson(CompletionKind::kChat, head, "he", "", true);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], json({{"role", "assistant"}, {"content", "he"}}));
  const json last = CompletionChunkJson(CompletionKind::kChat, head, "", "stop", false);
  EXPECT_EQ(last["choices"][0]["delta"], json::object());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  const json usage = UsageChunkJson(CompletionKind::kChat, head);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 7);
}

TEST(OpenAiApiTest, SseFramingAndInvalidUtf8) {
  EXPECT_EQ(SseEvent(json({{"a", 1}})), "data: {\"a\":1}\n\n");
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
  // A lone continuation byte never throws; it becomes U+FFFD.
  EXPECT_EQ(DumpJson(json("a\x80z")), "\"a\xEF\xBF\xBDz\"");
}

TEST(OpenAiApiTest, ModelObject) {
  const nlohmann::json model = ModelJson("m", 5, 4096);
  EXPECT_EQ(model["id"], "m");
  EXPECT_EQ(model["object"], "model");
  EXPECT_EQ(model["max_model_len"], 4096);
}

TEST(OpenAiApiTest, ModelList) {
  const json list = ModelListJson("tiny", 5, 4096);
  EXPECT_EQ(list["object"], "list");
  ASSERT_EQ(list["data"].size(), 1u);
  EXPECT_EQ(list["data"][0]["id"], "tiny");
  EXPECT_EQ(list["data"][0]["object"], "model");
  EXPECT_EQ(list["data"][0]["max_model_len"], 4096);
}

// The cut events equal the JSON tree's for every kind of text: quotes, escapes, control
// characters, DEL, UTF-8, invalid UTF-8 (U+FFFD), and an empty chat delta (no content).
TEST(OpenAiApiTest, TextChunkEventsEqualTheChunkJson) {
  CompletionResult head;
  head.id = "cmpl-7f3a\"x";
  head.created = 1700000000;
  head.model = "tiny-qwen3";
  const std::vector<std::string> texts = {
      "", "he", " world", "a\"b\\c", "\n\r\t\b\f", std::string("\x01\x1f\x7f", 3),
      std::string(1, '\0'), "caf\xc3\xa9 \xe4\xb8\xad", "bad \xff\xc3", "</script>"};
  for (CompletionKind kind : {CompletionKind::kText, CompletionKind::kChat}) {
    const TextChunkEvents events(kind, head);
    for (const std::string& text : texts) {
      std::string out = "prefix";
      events.Append(text, out);
      EXPECT_EQ(out, "prefix" + SseEvent(CompletionChunkJson(kind, head, text, "", false)))
          << "text of " << text.size() << " bytes, kind " << static_cast<int>(kind);
    }
  }
}

}  // namespace
}  // namespace rubato::server
