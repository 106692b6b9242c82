// The OpenAI API's wire format for `rubato serve`: request bodies of /v1/completions and
// /v1/chat/completions parsed and checked field by field, and the response, stream-chunk, model
// list and error JSON that OpenAI clients (and vLLM / SGLang clients) expect.
//
// Every parse error is an ApiError naming the field (`param`) with a message saying what was
// expected and what came. A field rubato does not implement is refused by name, never silently
// ignored: unknown fields (tools, suffix, ...) and values of known ones that ask for a missing
// feature (n > 1, best_of > 1, echo, response_format other than text). A field sent as null
// counts as absent, as OpenAI reads it. The accepted fields: docs/serving.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
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
  // Tokens to generate at most: chat's max_completion_tokens wins over max_tokens. Unset: 16 for
  // completions (OpenAI's default), the rest of the context for chat.
  std::optional<int> max_tokens;
  float temperature = 1.f;  // OpenAI's default; 0 = greedy
  float top_p = 1.f;        // (0, 1]
  int top_k = 0;            // extension (vLLM): 0 or -1 = off
  std::optional<uint64_t> seed;   // unset: a fresh seed per request
  float presence_penalty = 0.f;   // [-2, 2]
  float frequency_penalty = 0.f;  // [-2, 2]
  // logit_bias: (token id, bias in [-100, 100]), in token id order; ids unchecked against the
  // vocabulary (the router does that).
  std::vector<std::pair<int, float>> logit_bias;
  float repetition_penalty = 1.f;  // vLLM's extension, (0, 2]; 1 = off
  bool ignore_eos = false;         // vLLM's extension: the model's end-of-sequence does not stop
  // Log-probabilities per generated token: -1 none; else how many alternatives (0..20). From
  // completions' `logprobs` (an integer), chat's `logprobs: true` with `top_logprobs`.
  int logprobs = -1;
  std::vector<std::string> stop;  // non-empty strings; the text ends before the first found
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage: a final chunk with usage
};

// Parses and checks a request body. On error, returns it and leaves `out` partly filled.
std::optional<ApiError> ParseCompletionRequest(std::string_view body, CompletionKind kind,
                                               CompletionRequest& out);

// One generated token's log-probabilities, with the text of each token (its bytes, maybe not
// whole UTF-8), for the response JSON.
struct TokenLogprobText {
  std::string token;
  float logprob = 0.f;
  std::vector<std::pair<std::string, float>> top;  // most likely first
};
// Completions' choices[].logprobs {tokens, token_logprobs, top_logprobs, text_offset} of
// `tokens`, offsets counted from `text_offset` (advanced past them). The sampled token joins its
// top_logprobs object, as vLLM's do.
nlohmann::json CompletionLogprobsJson(const std::vector<TokenLogprobText>& tokens,
                                      size_t& text_offset);
// Chat's choices[].logprobs {content: [{token, logprob, bytes, top_logprobs}]}.
nlohmann::json ChatLogprobsJson(const std::vector<TokenLogprobText>& tokens);

// What a finished request produced, for the response JSON.
struct CompletionResult {
  std::string id;  // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
  std::string text;
  std::string finish_reason;  // "stop" | "length"
  int prompt_tokens = 0;
  int completion_tokens = 0;
  nlohmann::json logprobs;  // choices[].logprobs: null when not asked for
};

nlohmann::json UsageJson(int prompt_tokens, int completion_tokens);
// `text_completion` / `chat.completion` object.
nlohmann::json CompletionResponseJson(CompletionKind kind, const CompletionResult& result);
// One `text_completion` / `chat.completion.chunk` stream chunk. `text` is the new text (chat:
// delta.content; `first` adds delta.role "assistant"); `finish_reason` "" is JSON null;
// `logprobs` the chunk's tokens' (null: none asked for).
nlohmann::json CompletionChunkJson(CompletionKind kind, const CompletionResult& head,
                                   std::string_view text, std::string_view finish_reason,
                                   bool first, const nlohmann::json& logprobs = nullptr);
// The final usage-only chunk of stream_options.include_usage (choices: []).
nlohmann::json UsageChunkJson(CompletionKind kind, const CompletionResult& result);
// GET /v1/models: a list with the one served model.
nlohmann::json ModelListJson(const std::string& model, int64_t created, int max_context);
// GET /v1/models/{id}: the model object itself.
nlohmann::json ModelJson(const std::string& model, int64_t created, int max_context);

// Server-Sent Events framing: "data: <json>\n\n", and the terminator "data: [DONE]\n\n".
std::string SseEvent(const nlohmann::json& payload);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// Compact JSON text that never throws: invalid UTF-8 in strings becomes U+FFFD.
std::string DumpJson(const nlohmann::json& value);

// The SSE events of one stream's text chunks, byte for byte SseEvent(CompletionChunkJson(kind,
// head, text, "", false)), without a JSON tree per token: the event is cut around its text once,
// and each token's text is escaped between the two parts. What the engine thread writes for
// every token of a streamed reply.
class TextChunkEvents {
 public:
  TextChunkEvents(CompletionKind kind, const CompletionResult& head);
  // Appends the event of `text` to `out`.
  void Append(std::string_view text, std::string& out) const;

 private:
  CompletionKind kind_;
  CompletionResult head_;  // id, created, model: for the events the cut does not cover
  std::string before_, after_;  // the event around its quoted text; empty: no cut was found
};

}  // namespace rubato::server
