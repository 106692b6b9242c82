// Routes of `rubato serve` and the adapter from ServingEngine updates to OpenAI responses and
// SSE chunks (see openai_router.h).
#include "inference_rank/server/openai_router.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <utility>

#include "common/logging.h"
#include "inference_rank/server/request_id.h"

namespace rubato::server {
namespace {

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// "cmpl-<request id>" / "chatcmpl-<request id>", as vLLM names a completion after x-request-id.
std::string CompletionId(CompletionKind kind, const std::string& request_id) {
  return (kind == CompletionKind::kText ? "cmpl-" : "chatcmpl-") + request_id;
}

// Compares a presented secret with the expected one in time that depends only on the expected
// one's length (no early exit at the first differing byte).
bool ConstantTimeEquals(std::string_view presented, std::string_view expected) {
  unsigned char difference = presented.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const char got = i < presented.size() ? presented[i] : '\0';
    difference |= static_cast<unsigned char>(got ^ expected[i]);
  }
  return difference == 0;
}

// ServingUpdate::logprobs with each token's text (its bytes; special tokens by name).
std::vector<TokenLogprobText> LogprobTexts(
    const Tokenizer& tokenizer, const std::vector<std::pair<int, TokenLogprobs>>& tokens) {
  const auto text = [&tokenizer](int id) {
    return tokenizer.Decode(std::span<const int>(&id, 1), /*skip_special_tokens=*/false);
  };
  std::vector<TokenLogprobText> out;
  out.reserve(tokens.size());
  for (const auto& [id, logprobs] : tokens) {
    TokenLogprobText token{text(id), logprobs.logprob, {}};
    for (const auto& [alternative, logprob] : logprobs.top) {
      token.top.emplace_back(text(alternative), logprob);
    }
    out.push_back(std::move(token));
  }
  return out;
}

ApiError Error(int status, std::string message, std::string type, std::string param = "",
               std::string code = "") {
  return ApiError{status, std::move(message), std::move(type), std::move(param), std::move(code)};
}

// The status of a request that failed in the engine: the client's fault when the engine refused
// it as submitted, else the server's.
ApiError EngineError(const ServingUpdate& update) {
  if (update.rejected) return Error(400, update.error.message(), "invalid_request_error");
  if (update.error.code() == StatusCode::kDeadlineExceeded) {
    return Error(504, update.error.message(), "timeout_error", "", "request_timeout");
  }
  if (update.error.code() == StatusCode::kResourceExhausted) {
    // Its KV does not fit what is free (the cache rank's budget): this request's failure, not
    // the server's; it may fit once other requests end.
    return Error(507, update.error.message(), "insufficient_storage_error", "",
                 "kv_budget_exhausted");
  }
  return Error(503, update.error.message(), "service_unavailable_error");
}

// Headers of an error reply: a timed-out request would time out again, so OpenAI's SDKs must not
// retry it (they retry 5xx unless told so).
HttpHeaders ErrorHeaders(const ApiError& error) {
  if (error.code == "request_timeout") return {{"x-should-retry", "false"}};
  if (error.code == "queue_full") return {{"Retry-After", "1"}};  // seconds; a slot frees soon
  return {};
}

// A full queue, the request workers' or the engine's: 429 (with Retry-After, ErrorHeaders).
ApiError QueueFull(std::string message) {
  return Error(429, std::move(message), "rate_limit_error", "", "queue_full");
}

// What the engine thread accumulates for one request (its on_update closure owns it).
struct ReplyState {
  std::shared_ptr<PendingReply> reply;
  CompletionKind kind;
  bool stream = false;
  bool include_usage = false;
  bool stream_started = false;
  CompletionResult result;  // id, created, model; text and counts as they come
  const Tokenizer* tokenizer = nullptr;  // logprobs' token texts
  bool logprobs = false;                 // the request asked for logprobs
  std::vector<TokenLogprobText> logprob_tokens;  // not streamed: all of them so far
  size_t text_offset = 0;                // completions' text_offset of the next token
  std::optional<TextChunkEvents> text_events;  // streams: the events of plain text chunks
};

// The logprobs JSON of the tokens of one update (or of the whole reply).
nlohmann::json LogprobsJson(ReplyState& state, const std::vector<TokenLogprobText>& tokens) {
  if (state.kind == CompletionKind::kText) return CompletionLogprobsJson(tokens, state.text_offset);
  return ChatLogprobsJson(tokens);
}

void OnUpdate(ReplyState& state, const ServingUpdate& update) {
  CompletionResult& result = state.result;
  result.prompt_tokens = update.prompt_tokens;
  result.completion_tokens = update.completion_tokens;
  if (!update.error.ok()) {
    const ApiError error = EngineError(update);
    if (state.stream_started) {
      // Mid-stream: an error event and [DONE] (as vLLM ends a failed stream: clients that wait
      // for [DONE] see the end), then the connection closes.
      state.reply->Write("data: " + ApiErrorBody(error) + "\n\n" + std::string(kSseDone));
      state.reply->EndStream(/*close_connection=*/true);
    } else {
      state.reply->Complete(error.http_status, "application/json", ApiErrorBody(error),
                            ErrorHeaders(error));
    }
    return;
  }
  std::vector<TokenLogprobText> tokens;
  if (state.logprobs) tokens = LogprobTexts(*state.tokenizer, update.logprobs);
  if (!state.stream) {
    result.text += update.text;
    if (state.logprobs) {
      for (TokenLogprobText& token : tokens) state.logprob_tokens.push_back(std::move(token));
    }
    if (update.finished) {
      result.finish_reason = update.finish_reason;
      if (state.logprobs) result.logprobs = LogprobsJson(state, state.logprob_tokens);
      state.reply->Complete(200, "application/json",
                            DumpJson(CompletionResponseJson(state.kind, result)));
    }
    return;
  }
  std::string events;
  const bool first = !state.stream_started;
  if (first) {
    state.reply->StartStream("text/event-stream");
    state.stream_started = true;
  }
  if (!update.text.empty() || !tokens.empty() || (first && state.kind == CompletionKind::kChat)) {
    if (!first && !state.logprobs) {
      state.text_events->Append(update.text, events);  // most tokens: no JSON tree
    } else {
      const nlohmann::json logprobs = state.logprobs ? LogprobsJson(state, tokens) : nullptr;
      events += SseEvent(CompletionChunkJson(state.kind, result, update.text, "", first, logprobs));
    }
  }
  if (update.finished) {
    // A requested logprobs is never null, even in a chunk without tokens.
    const nlohmann::json logprobs = state.logprobs ? LogprobsJson(state, {}) : nullptr;
    events += SseEvent(
        CompletionChunkJson(state.kind, result, "", update.finish_reason, false, logprobs));
    if (state.include_usage) events += SseEvent(UsageChunkJson(state.kind, result));
    events += kSseDone;
  }
  state.reply->Write(std::move(events));
  if (update.finished) state.reply->EndStream();
}

// A completion's fate between the I/O thread, where its client's cancel comes from, and the
// worker that submits it: the cancel may come before, while or after the request reaches the
// engine.
class Admission {
 public:
  // The client went away: returns the serving id to cancel once the request is in the engine.
  std::optional<uint64_t> Cancel() {
    std::lock_guard<std::mutex> lock(mutex_);
    cancelled_ = true;
    return id_;
  }
  bool cancelled() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return cancelled_;
  }
  // Submits the request; one whose client left while it was prepared is cancelled at once, so
  // that the engine ends it unrun and counts it aborted, as every request whose client left.
  Result<uint64_t> Submit(ServingEngine& serving, ServingRequest request) {
    std::unique_lock<std::mutex> lock(mutex_);
    Result<uint64_t> id = serving.Submit(std::move(request));
    if (!id.ok()) return id;
    id_ = *id;
    const bool cancelled = cancelled_;
    lock.unlock();
    if (cancelled) serving.Cancel(*id);
    return id;
  }

 private:
  mutable std::mutex mutex_;
  bool cancelled_ = false;
  std::optional<uint64_t> id_;
};

}  // namespace

struct OpenAiRouter::CompletionJob {
  std::string request_id;  // x-request-id: the completion's id suffix
  std::shared_ptr<PendingReply> reply;
  std::shared_ptr<Admission> admission;
  bool answered = false;  // the reply is complete, or the engine completes it

  void Answer(const ApiError& error) {
    answered = true;
    reply->Complete(error.http_status, "application/json", ApiErrorBody(error),
                    ErrorHeaders(error));
  }
  // A job the workers dropped unrun (the server stopped): its client gets a 503.
  ~CompletionJob() {
    if (!answered) {
      Answer(Error(503, "the server is shutting down and takes no new requests",
                   "service_unavailable_error"));
    }
  }
};

std::string ModelNameFromDirectory(const std::string& model_dir) {
  std::filesystem::path path = std::filesystem::path(model_dir).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();
  const std::string name = path.filename().string();
  return name.empty() || name == "." ? model_dir : name;
}

HttpReply ErrorReply(const ApiError& error) {
  return HttpReply{error.http_status, "application/json", ApiErrorBody(error), nullptr,
                   ErrorHeaders(error)};
}

OpenAiRouter::OpenAiRouter(ServingEngine* serving, const Tokenizer* tokenizer,
                           const MetricsRegistry* metrics, OpenAiRouterOptions options)
    : serving_(serving),
      tokenizer_(tokenizer),
      metrics_(metrics),
      options_(std::move(options)),
      started_unix_s_(UnixSeconds()),
      workers_("request worker", options_.request_threads, options_.request_queue) {}

HttpHeaders OpenAiRouter::CorsHeaders(const HttpRequest& request) const {
  const std::string origin = request.Header("origin");
  if (origin.empty()) return {};
  for (const std::string& allowed : options_.cors_allowed_origins) {
    // A browser client reads the echoed request id only when it is exposed.
    if (allowed == "*") {
      return {{"Access-Control-Allow-Origin", "*"},
              {"Access-Control-Expose-Headers", "x-request-id"}};
    }
    if (allowed == origin) {
      return {{"Access-Control-Allow-Origin", origin},
              {"Access-Control-Expose-Headers", "x-request-id"},
              {"Vary", "Origin"}};
    }
  }
  return {};
}

std::optional<HttpReply> OpenAiRouter::RefuseUnauthorized(const HttpRequest& request) const {
  if (options_.api_key.empty()) return std::nullopt;
  const bool guarded = request.path.starts_with("/v1/") || request.path == "/v1" ||
                       (request.path == "/metrics" && options_.api_key_protects_metrics);
  if (!guarded) return std::nullopt;
  const std::string authorization = request.Header("authorization");
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.starts_with(kBearer) &&
      ConstantTimeEquals(std::string_view(authorization).substr(kBearer.size()),
                         options_.api_key)) {
    return std::nullopt;
  }
  HttpReply reply = ErrorReply(Error(401,
                                     authorization.empty()
                                         ? "no API key: send 'Authorization: Bearer <key>' "
                                           "(rubato serve --api-key / server.api_key)"
                                         : "incorrect API key in the Authorization header",
                                     "invalid_request_error", "", "invalid_api_key"));
  reply.headers.emplace_back("WWW-Authenticate", "Bearer");
  return reply;
}

HttpReply OpenAiRouter::Handle(const HttpRequest& request) {
  HttpHeaders cors = CorsHeaders(request);
  // The client's x-request-id, echoed on every reply; a new one when it sent none.
  const std::string client_id = request.Header("x-request-id");
  const bool valid_id = ValidRequestId(client_id);
  const std::string request_id = valid_id ? client_id : NewRequestId();
  const bool preflight = request.method == "OPTIONS" && !cors.empty();
  cors.emplace_back("x-request-id", request_id);
  if (preflight &&
      !request.Header("access-control-request-method").empty()) {  // a CORS preflight
    const std::string asked = request.Header("access-control-request-headers");
    cors.emplace_back("Access-Control-Allow-Methods", "GET, POST, HEAD, OPTIONS");
    cors.emplace_back("Access-Control-Allow-Headers",
                      asked.empty() ? "authorization, content-type" : asked);
    cors.emplace_back("Access-Control-Max-Age", "600");
    return HttpReply{204, "text/plain; charset=utf-8", "", nullptr, std::move(cors)};
  }
  std::optional<HttpReply> refused = RefuseUnauthorized(request);
  if (!refused && !client_id.empty() && !valid_id) {
    refused = ErrorReply(Error(400,
                               "the x-request-id header must be 1 to " +
                                   std::to_string(kMaxRequestIdLength) +
                                   " visible ASCII characters, got " +
                                   std::to_string(client_id.size()) + " bytes",
                               "invalid_request_error", "x-request-id"));
  }
  HttpReply reply = refused ? std::move(*refused) : Route(request, request_id);
  if (reply.pending != nullptr) {
    reply.pending->SetHeaders(std::move(cors));
  } else {
    reply.headers.insert(reply.headers.end(), cors.begin(), cors.end());
  }
  return reply;
}

HttpReply OpenAiRouter::Route(const HttpRequest& request, const std::string& request_id) {
  const std::string& path = request.path;
  // HEAD is GET without the body (the HTTP server drops it).
  const bool get = request.method == "GET" || request.method == "HEAD";
  const bool post = request.method == "POST";
  const auto wrong_method = [&](const char* allowed) {
    return ErrorReply(
        Error(405, "method " + request.method + " is not allowed on " + path + "; use " + allowed,
              "invalid_request_error", "", "method_not_allowed"));
  };
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (!post) return wrong_method("POST");
    return Completion(request,
                      path == "/v1/completions" ? CompletionKind::kText : CompletionKind::kChat,
                      request_id);
  }
  if (path == "/v1/models") {
    if (!get) return wrong_method("GET");
    return HttpReply{
        200, "application/json",
        DumpJson(ModelListJson(options_.model_name, started_unix_s_, serving_->max_context())),
        nullptr};
  }
  constexpr std::string_view kModelPrefix = "/v1/models/";
  if (path.starts_with(kModelPrefix)) {
    if (!get) return wrong_method("GET");
    const std::string id = path.substr(kModelPrefix.size());
    if (id != options_.model_name) {
      return ErrorReply(Error(
          404,
          "the model '" + id + "' does not exist; this server serves '" + options_.model_name + "'",
          "invalid_request_error", "model", "model_not_found"));
    }
    return HttpReply{
        200, "application/json",
        DumpJson(ModelJson(options_.model_name, started_unix_s_, serving_->max_context())),
        nullptr};
  }
  if (path == "/health") {
    if (!get) return wrong_method("GET or HEAD");
    const Status health = serving_->Health();
    if (health.ok()) return HttpReply{200, "text/plain; charset=utf-8", "ok", nullptr};
    return ErrorReply(Error(503, health.message(), "service_unavailable_error"));
  }
  if (path == "/metrics") {
    if (!get) return wrong_method("GET");
    return HttpReply{200, kExpositionContentType,
                     metrics_ != nullptr ? metrics_->ExpositionText() : std::string(), nullptr};
  }
  return ErrorReply(Error(404,
                          "no route for " + request.method + " " + path +
                              " (rubato serves /v1/completions, /v1/chat/completions, "
                              "/v1/models, /health, /metrics)",
                          "invalid_request_error", "", "not_found"));
}

std::optional<ApiError> OpenAiRouter::PromptIds(const CompletionRequest& request,
                                                std::vector<int>& ids) const {
  if (request.kind == CompletionKind::kChat) {
    Result<std::string> text = tokenizer_->ApplyChatTemplate(request.messages);
    if (!text.ok()) return Error(400, text.status().message(), "invalid_request_error", "messages");
    // The template holds every special token already.
    ids = tokenizer_->Encode(*text, /*add_special_tokens=*/false);
  } else if (request.prompt_text) {
    // Like `rubato generate --prompt`: the post-processor adds BOS where the model has one.
    ids = tokenizer_->Encode(*request.prompt_text, /*add_special_tokens=*/true);
  } else {
    ids = request.prompt_ids;
  }
  const char* param = request.kind == CompletionKind::kChat ? "messages" : "prompt";
  if (ids.empty()) return Error(400, "the prompt is empty", "invalid_request_error", param);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= serving_->vocab_size()) {
      return Error(400,
                   "prompt token " + std::to_string(i) + " is " + std::to_string(ids[i]) +
                       ", outside the vocabulary [0, " + std::to_string(serving_->vocab_size()) +
                       ")",
                   "invalid_request_error", param);
    }
  }
  const int tokens = static_cast<int>(ids.size());
  if (options_.max_prompt_tokens > 0 && tokens > options_.max_prompt_tokens) {
    return Error(400,
                 "the prompt has " + std::to_string(tokens) +
                     " tokens but limits.max_prompt_tokens is " +
                     std::to_string(options_.max_prompt_tokens),
                 "invalid_request_error", param, "context_length_exceeded");
  }
  if (tokens >= serving_->max_context()) {
    return Error(400,
                 "the prompt has " + std::to_string(tokens) +
                     " tokens but the model's context is " +
                     std::to_string(serving_->max_context()) + " tokens, generated ones included",
                 "invalid_request_error", param, "context_length_exceeded");
  }
  return std::nullopt;
}

struct OpenAiRouter::Prepared {
  ServingRequest request;  // without on_update
  bool stream = false;
  bool include_usage = false;
};

std::optional<ApiError> OpenAiRouter::Prepare(std::string_view body, CompletionKind kind,
                                              Prepared& out) const {
  CompletionRequest request;
  if (auto error = ParseCompletionRequest(body, kind, request)) return error;
  if (request.model && *request.model != options_.model_name) {
    return Error(404,
                 "the model '" + *request.model + "' does not exist; this server serves '" +
                     options_.model_name + "'",
                 "invalid_request_error", "model", "model_not_found");
  }
  GenerationRequest& generation = out.request.generation;
  if (auto error = PromptIds(request, generation.prompt_ids)) return error;
  const int prompt_tokens = static_cast<int>(generation.prompt_ids.size());
  generation.max_new_tokens = request.max_tokens.value_or(
      kind == CompletionKind::kText ? 16 : serving_->max_context() - prompt_tokens);
  uint64_t seed = 0;
  if (request.seed) {
    seed = *request.seed;
  } else {
    thread_local std::mt19937_64 seeds(std::random_device{}());
    seed = seeds();
  }
  generation.sampling = {request.temperature, request.top_k, request.top_p, seed};
  generation.sampling.repetition_penalty = request.repetition_penalty;
  generation.sampling.logprobs = request.logprobs;
  generation.ignore_eos = request.ignore_eos;
  if (request.presence_penalty != 0.f || request.frequency_penalty != 0.f ||
      !request.logit_bias.empty()) {
    for (const auto& [id, bias] : request.logit_bias) {
      if (id >= serving_->vocab_size()) {
        return Error(400,
                     "'logit_bias' token " + std::to_string(id) +
                         " is outside the vocabulary [0, " +
                         std::to_string(serving_->vocab_size()) + ")",
                     "invalid_request_error", "logit_bias");
      }
    }
    generation.sampling.presence_penalty = request.presence_penalty;
    generation.sampling.frequency_penalty = request.frequency_penalty;
    generation.sampling.logit_bias = request.logit_bias;
  }
  out.request.stop_strings = std::move(request.stop);
  out.stream = request.stream;
  out.include_usage = request.include_usage;
  return std::nullopt;
}

HttpReply OpenAiRouter::Completion(const HttpRequest& http_request, CompletionKind kind,
                                   const std::string& request_id) {
  auto job = std::make_shared<CompletionJob>();
  job->request_id = request_id;
  job->reply = std::make_shared<PendingReply>();
  job->admission = std::make_shared<Admission>();
  ServingEngine* serving = serving_;
  // The client may go away while its request waits for a worker, while it is tokenized, or once
  // it reached the engine; Admission tells the worker, or the engine.
  job->reply->SetOnCancel([serving, admission = job->admission] {
    if (const std::optional<uint64_t> id = admission->Cancel()) serving->Cancel(*id);
  });
  // The body is copied (milliseconds for the largest) so that the worker owns what it reads.
  const bool queued = workers_.TryPost([this, job, kind, body = http_request.body] {
    if (job->admission->cancelled()) {
      job->answered = true;  // nobody waits for the answer
      return serving_->CountEndedBeforeSubmit(RequestEnd::kAborted);
    }
    Prepared prepared;
    try {
      if (auto error = Prepare(body, kind, prepared)) return job->Answer(*error);
    } catch (const std::exception& e) {  // a bug: one 500, the server goes on
      RUBATO_LOG_ERROR("http", "preparing a completion threw: {}", e.what());
      return job->Answer(Error(500, std::string("internal error: ") + e.what(), "internal_error"));
    }
    Admit(std::move(prepared), kind, *job);
  });
  if (!queued) {
    job->answered = true;  // this reply, not the job's
    serving_->CountEndedBeforeSubmit(RequestEnd::kRejected);
    return ErrorReply(QueueFull("the server is busy: " + std::to_string(workers_.queued()) +
                                " requests wait to be tokenized (server.request_queue " +
                                std::to_string(options_.request_queue) + "); retry later"));
  }
  return HttpReply{200, "application/json", "", job->reply};
}

void OpenAiRouter::Admit(Prepared prepared, CompletionKind kind, CompletionJob& job) {
  auto state = std::make_shared<ReplyState>();
  state->reply = job.reply;
  state->kind = kind;
  state->stream = prepared.stream;
  state->include_usage = prepared.include_usage;
  state->result.id = CompletionId(kind, job.request_id);
  state->tokenizer = tokenizer_;
  state->logprobs = prepared.request.generation.sampling.logprobs >= 0;
  state->result.created = UnixSeconds();
  state->result.model = options_.model_name;
  if (state->stream) state->text_events.emplace(kind, state->result);
  ServingRequest& request = prepared.request;
  request.on_update = [state](const ServingUpdate& update) { OnUpdate(*state, update); };
  const Result<uint64_t> id = job.admission->Submit(*serving_, std::move(request));
  job.answered = true;
  if (id.ok()) return;
  if (id.status().code() == StatusCode::kResourceExhausted) {
    return job.Answer(QueueFull(id.status().message()));
  }
  job.Answer(Error(503, id.status().message(), "service_unavailable_error"));
}

}  // namespace rubato::server
