// The OpenAI API's wire format for `rubato serve`: request bodies of /v1/completions and
// /v1/chat/completions parsed and checked field by field, and the response, stream-chunk, model
// list and error JSON that OpenAI clients (and vLLM / SGLang clients) expect.
//
// Every parse error is an ApiError naming the field (`param`) with a message saying what was
// expected and what came; unknown fields are ignored, as OpenAI-compatible servers do, except
// features rubato does not implement (n > 1, best_of > 1, echo, logprobs), which are refused by
// name rather than silently ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/tokenizer/chat_template.h"

namespace rubato::server {

// An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the request field at fault; "" for none (JSON null)
  std::string code;   // machine-readable reason, e.g. "model_not_found"; "" for none
};
std::string ApiErrorBody(const ApiError& error);

enum class CompletionKind { kText, kChat };  // /v1/completions, /v1/chat/completions

struct CompletionRequest {
  CompletionKind kind = CompletionKind::kText;
  std::optional<std::string> model;
  // kText: exactly one of a text prompt and token ids.
  std::optional<std::string> prompt_text;
  std::vector<int> prompt_ids;
  std::vector<ChatMessage> messages;  // kChat, in order
  // Tokens to generate at most. Unset: 16 for completions (OpenAI's default), the rest of the
  // context for chat.
  std::optional<int> max_tokens;
  float temperature = 1.f;  // OpenAI's default; 0 = greedy
  float top_p = 1.f;        // (0, 1]
  int top_k = 0;            // extension (vLLM): 0 or -1 = off
  std::optional<uint64_t> seed;   // unset: a fresh seed per request
  std::vector<std::string> stop;  // non-empty strings; the text ends before the first found
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage: a final chunk with usage
};

// Parses and checks a request body. On error, returns it and leaves `out` partly filled.
std::optional<ApiError> ParseCompletionRequest(std::string_view body, CompletionKind kind,
                                               CompletionRequest& out);

// What a finished request produced, for the response JSON.
struct CompletionResult {
  std::string id;  // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
  std::string text;
  std::string finish_reason;  // "stop" | "length"
  int prompt_tokens = 0;
  int completion_tokens = 0;
};

nlohmann::json UsageJson(int prompt_tokens, int completion_tokens);
// `text_completion` / `chat.completion` object.
nlohmann::json CompletionResponseJson(CompletionKind kind, const CompletionResult& result);
// One `text_completion` / `chat.completion.chunk` stream chunk. `text` is the new text (chat:
// delta.content; `first` adds delta.role "assistant"); `finish_reason` "" is JSON null.
nlohmann::json CompletionChunkJson(CompletionKind kind, const CompletionResult& head,
                                   std::string_view text, std::string_view finish_reason,
                                   bool first);
// The final usage-only chunk of stream_options.include_usage (choices: []).
nlohmann::json UsageChunkJson(CompletionKind kind, const CompletionResult& result);
// GET /v1/models: a list with the one served model.
nlohmann::json ModelListJson(const std::string& model, int64_t created, int max_context);

// Server-Sent Events framing: "data: <json>\n\n", and the terminator "data: [DONE]\n\n".
std::string SseEvent(const nlohmann::json& payload);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// Compact JSON text that never throws: invalid UTF-8 in strings becomes U+FFFD.
std::string DumpJson(const nlohmann::json& value);

}  // namespace rubato::server
