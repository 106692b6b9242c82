// The routes of `rubato serve`: the OpenAI endpoints (/v1/completions, /v1/chat/completions,
// /v1/models, /v1/models/{id}) on a ServingEngine, /health and /metrics (GET or HEAD), CORS when
// configured, and JSON 404 / 405 for anything else.
// Turns a parsed request into prompt tokens and a GenerationRequest, and the ServingEngine's
// updates into a response or a Server-Sent Events stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/server/http_server.h"
#include "inference_rank/server/openai_api.h"
#include "inference_rank/server/serving_engine.h"

namespace rubato::server {

struct OpenAiRouterOptions {
  std::string model_name;     // what `model` must equal (the model directory's last component)
  int max_prompt_tokens = 0;  // limits.max_prompt_tokens; 0: the engine's context
  // server.cors_allowed_origins: "*" or exact origins; empty: no CORS headers, OPTIONS is 405.
  std::vector<std::string> cors_allowed_origins = {};
};

class OpenAiRouter {
 public:
  // All three must outlive the router (and every reply it started).
  OpenAiRouter(ServingEngine* serving, const Tokenizer* tokenizer, const MetricsRegistry* metrics,
               OpenAiRouterOptions options);

  HttpReply Handle(const HttpRequest& request);

 private:
  HttpReply Route(const HttpRequest& request);
  // The CORS headers for the request's Origin: none unless it is allowed.
  HttpHeaders CorsHeaders(const HttpRequest& request) const;
  HttpReply Completion(const HttpRequest& request, CompletionKind kind);
  // The prompt's token ids, or the error naming the field.
  std::optional<ApiError> PromptIds(const CompletionRequest& request, std::vector<int>& ids) const;

  ServingEngine* serving_;
  const Tokenizer* tokenizer_;
  const MetricsRegistry* metrics_;
  OpenAiRouterOptions options_;
  int64_t started_unix_s_;
};

// The served model's name: the last component of its directory ("models/tiny-qwen3/" ->
// "tiny-qwen3").
std::string ModelNameFromDirectory(const std::string& model_dir);

// An error reply: the status and {"error": {...}} body.
HttpReply ErrorReply(const ApiError& error);

}  // namespace rubato::server
