// The routes of `rubato serve`: the OpenAI endpoints (/v1/completions, /v1/chat/completions,
// /v1/models, /v1/models/{id}) on a ServingEngine, /health and /metrics (GET or HEAD), CORS when
// configured, and JSON 404 / 405 for anything else. With an API key, /v1/* (and /metrics when
// configured) need `Authorization: Bearer <key>`: 401 otherwise. Every reply carries
// `x-request-id`: the client's (checked) or a new one, also the completion's id suffix.
// Turns a parsed request into prompt tokens and a GenerationRequest, and the ServingEngine's
// updates into a response or a Server-Sent Events stream. Completion bodies are parsed, templated
// and tokenized on request worker threads, never on the HTTP server's I/O thread: a 15 MB prompt
// takes seconds to tokenize, and /health and every other connection must not wait for it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/metrics.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/server/bounded_worker_pool.h"
#include "inference_rank/server/http_server.h"
#include "inference_rank/server/openai_api.h"
#include "inference_rank/server/serving_engine.h"

namespace rubato::server {

struct OpenAiRouterOptions {
  std::string model_name;     // what `model` must equal (the model directory's last component)
  int max_prompt_tokens = 0;  // limits.max_prompt_tokens; 0: the engine's context
  // server.cors_allowed_origins: "*" or exact origins; empty: no CORS headers, OPTIONS is 405.
  std::vector<std::string> cors_allowed_origins = {};
  // Threads that parse, template and tokenize completion requests (RequestThreads of
  // server.request_threads), and how many requests may wait for one (server.request_queue;
  // past it: 429).
  int request_threads = 1;
  int request_queue = 64;
  std::string api_key = {};               // server.api_key; empty: no authentication
  bool api_key_protects_metrics = false;  // server.api_key_protects_metrics
};

class OpenAiRouter {
 public:
  // All three must outlive the router (and every reply it started).
  OpenAiRouter(ServingEngine* serving, const Tokenizer* tokenizer, const MetricsRegistry* metrics,
               OpenAiRouterOptions options);
  // Stops the request workers: requests waiting for one end with a 503, those being prepared
  // finish (Submit refuses them once the ServingEngine has stopped).
  ~OpenAiRouter() = default;

  // On the I/O thread; never blocks: a completion answers with a PendingReply at once.
  HttpReply Handle(const HttpRequest& request);

 private:
  struct Prepared;       // a completion request checked and tokenized, ready for the engine
  struct CompletionJob;  // one completion between the I/O thread, a worker and the engine
  HttpReply Route(const HttpRequest& request, const std::string& request_id);
  // The 401 for a request that needs the API key and lacks it, or nothing.
  std::optional<HttpReply> RefuseUnauthorized(const HttpRequest& request) const;
  // The CORS headers for the request's Origin: none unless it is allowed.
  HttpHeaders CorsHeaders(const HttpRequest& request) const;
  // Queues the request for a worker; 429 when too many wait already.
  HttpReply Completion(const HttpRequest& request, CompletionKind kind,
                       const std::string& request_id);
  // On a worker: parses, checks and tokenizes a body into `out`, or returns the error.
  std::optional<ApiError> Prepare(std::string_view body, CompletionKind kind, Prepared& out) const;
  // On a worker: submits a prepared request to the engine, whose updates complete the reply.
  void Admit(Prepared prepared, CompletionKind kind, CompletionJob& job);
  // The prompt's token ids, or the error naming the field.
  std::optional<ApiError> PromptIds(const CompletionRequest& request, std::vector<int>& ids) const;

  ServingEngine* serving_;
  const Tokenizer* tokenizer_;
  const MetricsRegistry* metrics_;
  OpenAiRouterOptions options_;
  int64_t started_unix_s_;
  // Last: stopped (queued requests answered, running ones finished) before the fields above go.
  BoundedWorkerPool workers_;
};

// The served model's name: the last component of its directory ("models/tiny-qwen3/" ->
// "tiny-qwen3").
std::string ModelNameFromDirectory(const std::string& model_dir);

// An error reply: the status and {"error": {...}} body.
HttpReply ErrorReply(const ApiError& error);

}  // namespace rubato::server
