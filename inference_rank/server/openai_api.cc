// OpenAI request parsing and response JSON (see openai_api.h).
#include "inference_rank/server/openai_api.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "common/json_limits.h"

namespace rubato::server {
namespace {

using nlohmann::json;

// OpenAI's limit on alternatives per token (top_logprobs; the legacy logprobs said 5).
constexpr int64_t kMaxTopLogprobs = 20;

ApiError FieldError(std::string param, std::string message) {
  ApiError error;
  error.message = std::move(message);
  error.param = std::move(param);
  return error;
}

// A value in an error message: at most a short prefix of what the client sent.
std::string MessageJson(const json& value) { return Excerpt(DumpJson(value), 64); }

// A key the client sent, in a message or `param`: a short prefix too (names are unbounded).
std::string KeyText(std::string_view key) { return Excerpt(key, 64); }

// "a string", "a number", ... : what a JSON value is, for messages.
std::string Describe(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "the number " + MessageJson(value);
    default:
      return "the integer " + MessageJson(value);
  }
}

// The value of `name`, or null when absent.
const json& Field(const json& body, const char* name) {
  static const json kNull;
  const auto it = body.find(name);
  return it == body.end() ? kNull : *it;
}

std::optional<ApiError> ReadNumber(const json& body, const char* name, double low, double high,
                                   bool low_open, float& out) {
  const json& value = Field(body, name);
  if (value.is_null()) return std::nullopt;
  char range_text[64];
  std::snprintf(range_text, sizeof(range_text), "%s%g, %g]", low_open ? "(" : "[", low, high);
  const std::string range = range_text;
  if (!value.is_number()) {
    return FieldError(name, "'" + std::string(name) + "' must be a number in " + range + ", got " +
                                Describe(value));
  }
  const double number = value.get<double>();
  if (!std::isfinite(number) || number > high || number < low || (low_open && number == low)) {
    return FieldError(
        name, "'" + std::string(name) + "' must be in " + range + ", got " + MessageJson(value));
  }
  out = static_cast<float>(number);
  return std::nullopt;
}

std::optional<ApiError> ReadInt(const json& body, const char* name, int64_t low, int64_t high,
                                std::optional<int64_t>& out) {
  const json& value = Field(body, name);
  if (value.is_null()) return std::nullopt;
  const std::string range = "[" + std::to_string(low) + ", " + std::to_string(high) + "]";
  if (!value.is_number_integer()) {
    return FieldError(name, "'" + std::string(name) + "' must be an integer in " + range +
                                ", got " + Describe(value));
  }
  // Unsigned values above INT64_MAX are out of range whatever the bounds.
  if (value.is_number_unsigned() &&
      value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return FieldError(
        name, "'" + std::string(name) + "' must be in " + range + ", got " + MessageJson(value));
  }
  const int64_t number = value.get<int64_t>();
  if (number < low || number > high) {
    return FieldError(name, "'" + std::string(name) + "' must be in " + range + ", got " +
                                std::to_string(number));
  }
  out = number;
  return std::nullopt;
}

std::optional<ApiError> ReadBool(const json& body, const char* name, bool& out) {
  const json& value = Field(body, name);
  if (value.is_null()) return std::nullopt;
  if (!value.is_boolean()) {
    return FieldError(name,
                      "'" + std::string(name) + "' must be true or false, got " + Describe(value));
  }
  out = value.get<bool>();
  return std::nullopt;
}

std::optional<ApiError> ReadPrompt(const json& body, CompletionRequest& out) {
  const json& prompt = Field(body, "prompt");
  if (prompt.is_string()) {
    out.prompt_text = prompt.get<std::string>();
    return std::nullopt;
  }
  if (prompt.is_array() && prompt.size() == 1 && prompt[0].is_string()) {
    out.prompt_text = prompt[0].get<std::string>();
    return std::nullopt;
  }
  if (prompt.is_array() && !prompt.empty() && prompt[0].is_number()) {
    for (size_t i = 0; i < prompt.size(); ++i) {
      const json& id = prompt[i];
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int>::max() ||
          (id.is_number_unsigned() && id.get<uint64_t>() > std::numeric_limits<int>::max())) {
        return FieldError("prompt", "'prompt' token " + std::to_string(i) +
                                        " must be a non-negative integer token id, got " +
                                        Describe(id));
      }
      out.prompt_ids.push_back(id.get<int>());
    }
    return std::nullopt;
  }
  if (prompt.is_null()) {
    return FieldError("prompt", "'prompt' is required: a string, or an array of token ids");
  }
  if (prompt.is_array() && prompt.size() > 1 && prompt[0].is_string()) {
    return FieldError("prompt", "'prompt' with " + std::to_string(prompt.size()) +
                                    " strings: rubato serves one prompt per request");
  }
  return FieldError("prompt",
                    "'prompt' must be a string, an array of one string or an array "
                    "of token ids, got " +
                        Describe(prompt));
}

std::optional<ApiError> ReadMessages(const json& body, CompletionRequest& out) {
  const json& messages = Field(body, "messages");
  if (!messages.is_array() || messages.empty()) {
    return FieldError("messages",
                      "'messages' must be a non-empty array of {\"role\", "
                      "\"content\"} objects, got " +
                          Describe(messages));
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& message = messages[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!message.is_object()) {
      return FieldError(where, "'" + where + "' must be an object, got " + Describe(message));
    }
    const json& role = Field(message, "role");
    if (!role.is_string() || (role != "system" && role != "user" && role != "assistant" &&
                              role != "tool" && role != "developer")) {
      return FieldError(where + ".role", "'" + where +
                                             ".role' must be one of system, user, "
                                             "assistant, tool, developer; got " +
                                             MessageJson(role));
    }
    // Role and content are implemented, and a participant `name` accepted (a string; chat
    // templates do not render it, as vLLM's do not for these models); `tool_calls`,
    // `tool_call_id`, `function_call`, `audio`, ... are refused by name (null counts as absent,
    // as the SDKs echo an assistant message's `refusal: null`).
    for (const auto& [key, value] : message.items()) {
      if (value.is_null() || key == "role" || key == "content") continue;
      const std::string field = where + "." + KeyText(key);
      if (key == "name") {
        if (value.is_string()) continue;
        return FieldError(field, "'" + field + "' must be a string, got " + Describe(value));
      }
      return FieldError(field, "'" + field +
                                   "' is not supported by rubato serve (a message has only role, "
                                   "content and name)");
    }
    ChatMessage chat{role.get<std::string>(), ""};
    if (chat.role == "developer") chat.role = "system";  // OpenAI's newer name for it
    const json& content = Field(message, "content");
    if (content.is_string()) {
      chat.content = content.get<std::string>();
    } else if (content.is_array()) {  // content parts: only text ones
      for (size_t p = 0; p < content.size(); ++p) {
        const json& part = content[p];
        if (!part.is_object() || Field(part, "type") != "text" ||
            !Field(part, "text").is_string()) {
          return FieldError(where + ".content",
                            "'" + where + ".content[" + std::to_string(p) +
                                "]' must be {\"type\": \"text\", \"text\": \"...\"} (rubato "
                                "serves text models)");
        }
        for (const auto& [key, value] : part.items()) {
          if (value.is_null() || key == "type" || key == "text") continue;
          const std::string at = where + ".content[" + std::to_string(p) + "]." + KeyText(key);
          return FieldError(where + ".content",
                            "'" + at +
                                "' is not supported by rubato serve (a content part has "
                                "only type and text)");
        }
        chat.content += Field(part, "text").get<std::string>();
      }
    } else if (!(content.is_null() && chat.role == "assistant")) {
      return FieldError(where + ".content",
                        "'" + where + ".content' must be a string, got " + Describe(content));
    }
    out.messages.push_back(std::move(chat));
  }
  return std::nullopt;
}

std::optional<ApiError> ReadStop(const json& body, CompletionRequest& out) {
  const json& stop = Field(body, "stop");
  if (stop.is_null()) return std::nullopt;
  // Bounded before anything is copied: each is matched against the text of every token.
  constexpr size_t kMaxStopStrings = 64;
  constexpr size_t kMaxStopBytes = 16384;
  if (stop.is_array() && stop.size() > kMaxStopStrings) {
    return FieldError("stop", "'stop' holds " + std::to_string(stop.size()) + " strings; at most " +
                                  std::to_string(kMaxStopStrings));
  }
  std::vector<json> items;
  if (stop.is_string()) {
    items.push_back(stop);
  } else if (stop.is_array()) {
    items.assign(stop.begin(), stop.end());
  } else {
    return FieldError("stop",
                      "'stop' must be a string or an array of strings, got " + Describe(stop));
  }
  size_t stop_bytes = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].is_string() || items[i].get_ref<const std::string&>().empty()) {
      return FieldError("stop", "'stop' item " + std::to_string(i) +
                                    " must be a non-empty string, got " + Describe(items[i]));
    }
    out.stop.push_back(items[i].get<std::string>());
    stop_bytes += out.stop.back().size();
    if (stop_bytes > kMaxStopBytes) {
      return FieldError("stop", "'stop' strings hold more than " + std::to_string(kMaxStopBytes) +
                                    " bytes together");
    }
  }
  return std::nullopt;
}

// The request fields rubato implements (or accepts with a value it implements).
bool KnownField(const std::string& name, CompletionKind kind) {
  static const char* const kCommon[] = {"model",
                                        "max_tokens",
                                        "temperature",
                                        "top_p",
                                        "top_k",
                                        "seed",
                                        "stop",
                                        "stream",
                                        "stream_options",
                                        "n",
                                        "logprobs",
                                        "presence_penalty",
                                        "frequency_penalty",
                                        "logit_bias",
                                        "user",
                                        "repetition_penalty",
                                        "ignore_eos",
                                        "response_format"};
  for (const char* known : kCommon) {
    if (name == known) return true;
  }
  if (kind == CompletionKind::kText) return name == "prompt" || name == "echo" || name == "best_of";
  return name == "messages" || name == "max_completion_tokens" || name == "top_logprobs";
}

std::optional<ApiError> RefuseUnknownFields(const json& body, CompletionKind kind) {
  for (const auto& [name, value] : body.items()) {
    if (value.is_null() || KnownField(name, kind)) continue;
    return FieldError(KeyText(name), "'" + KeyText(name) +
                                         "' is not supported by rubato serve (docs/serving.md "
                                         "lists the fields it accepts)");
  }
  return std::nullopt;
}

std::optional<ApiError> ReadLogitBias(const json& body, CompletionRequest& out) {
  const json& bias = Field(body, "logit_bias");
  if (bias.is_null()) return std::nullopt;
  if (!bias.is_object()) {
    return FieldError("logit_bias",
                      "'logit_bias' must be an object mapping token ids to a bias "
                      "in [-100, 100], got " +
                          Describe(bias));
  }
  for (const auto& [key, value] : bias.items()) {
    int64_t id = -1;
    const bool digits =
        !key.empty() && key.size() <= 9 && key.find_first_not_of("0123456789") == std::string::npos;
    if (digits) id = std::stoll(key);
    if (!digits) {
      return FieldError("logit_bias", "'logit_bias' key '" + KeyText(key) +
                                          "' must be a token id (a non-negative integer)");
    }
    if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < -100 ||
        value.get<double>() > 100) {
      return FieldError("logit_bias", "'logit_bias' of token " + key +
                                          " must be a number in [-100, 100], got " +
                                          MessageJson(value));
    }
    out.logit_bias.emplace_back(static_cast<int>(id), value.get<float>());
  }
  std::sort(out.logit_bias.begin(), out.logit_bias.end());
  for (size_t i = 1; i < out.logit_bias.size(); ++i) {
    if (out.logit_bias[i].first == out.logit_bias[i - 1].first) {  // "7" and "007"
      return FieldError("logit_bias", "'logit_bias' names token " +
                                          std::to_string(out.logit_bias[i].first) + " twice");
    }
  }
  return std::nullopt;
}

// Fields of features rubato does not implement: refused by name, never silently ignored.
std::optional<ApiError> RefuseUnsupported(const json& body, CompletionKind kind) {
  std::optional<int64_t> count;
  if (auto error = ReadInt(body, "n", 1, 1, count)) {
    error->message += " (rubato returns one choice per request)";
    return error;
  }
  if (auto error = ReadInt(body, "best_of", 1, 1, count)) return error;
  bool flag = false;
  if (auto error = ReadBool(body, "echo", flag)) return error;
  if (flag) return FieldError("echo", "'echo' is not supported by rubato serve");
  const json& format = Field(body, "response_format");
  if (!format.is_null()) {
    const json& type = format.is_object() ? Field(format, "type") : format;
    if (!format.is_object() || !type.is_string()) {
      return FieldError("response_format",
                        "'response_format' must be an object {\"type\": \"text\"}, got " +
                            Describe(format));
    }
    if (type != "text") {
      return FieldError("response_format.type",
                        "'response_format.type' " + MessageJson(type) +
                            " is not supported by rubato serve (only \"text\": no structured "
                            "output)");
    }
    for (const auto& [key, value] : format.items()) {
      if (value.is_null() || key == "type") continue;
      const std::string field = "response_format." + KeyText(key);
      return FieldError(field, "'" + field + "' is not supported by rubato serve");
    }
  }
  return std::nullopt;
}

// Completions: `logprobs` an integer in [0, 20]. Chat: `logprobs` a boolean and `top_logprobs`
// an integer in [0, 20] that needs it.
std::optional<ApiError> ReadLogprobs(const json& body, CompletionKind kind,
                                     CompletionRequest& out) {
  std::optional<int64_t> count;
  if (kind == CompletionKind::kText) {
    if (auto error = ReadInt(body, "logprobs", 0, kMaxTopLogprobs, count)) return error;
    if (count) out.logprobs = static_cast<int>(*count);
    return std::nullopt;
  }
  bool wanted = false;
  if (auto error = ReadBool(body, "logprobs", wanted)) return error;
  if (auto error = ReadInt(body, "top_logprobs", 0, kMaxTopLogprobs, count)) return error;
  if (count && !wanted) {
    return FieldError("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  if (wanted) out.logprobs = static_cast<int>(count.value_or(0));
  return std::nullopt;
}

}  // namespace

std::string DumpJson(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ApiErrorBody(const ApiError& error) {
  json body = {{"error",
                {{"message", error.message},
                 {"type", error.type},
                 {"param", error.param.empty() ? json() : json(error.param)},
                 {"code", error.code.empty() ? json() : json(error.code)}}}};
  return DumpJson(body);
}

std::optional<ApiError> ParseCompletionRequest(std::string_view body_text, CompletionKind kind,
                                               CompletionRequest& out) {
  out = CompletionRequest();
  out.kind = kind;
  // Bounded before parsing: a body nested 100k deep overflowed the stack (the parser and the
  // value's destruction recurse per level).
  if (const Status nesting = CheckJsonNesting(body_text, "the request body"); !nesting.ok()) {
    return FieldError("", nesting.message());
  }
  const json body = json::parse(body_text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return FieldError("", "the request body is not valid JSON");
  }
  if (!body.is_object()) {
    return FieldError("", "the request body must be a JSON object, got " + Describe(body));
  }
  const json& model = Field(body, "model");
  if (!model.is_null()) {
    if (!model.is_string()) {
      return FieldError("model", "'model' must be a string, got " + Describe(model));
    }
    out.model = model.get<std::string>();
  }
  if (auto error = RefuseUnsupported(body, kind)) return error;
  if (kind == CompletionKind::kText) {
    if (auto error = ReadPrompt(body, out)) return error;
  } else {
    if (auto error = ReadMessages(body, out)) return error;
  }
  if (auto error = RefuseUnknownFields(body, kind)) return error;
  std::optional<int64_t> max_tokens;
  if (auto error = ReadInt(body, "max_tokens", 1, 1 << 24, max_tokens)) return error;
  if (kind == CompletionKind::kChat) {  // OpenAI's newer name, which wins over max_tokens
    std::optional<int64_t> max_completion_tokens;
    if (auto error = ReadInt(body, "max_completion_tokens", 1, 1 << 24, max_completion_tokens)) {
      return error;
    }
    if (max_completion_tokens) max_tokens = max_completion_tokens;
  }
  if (max_tokens) out.max_tokens = static_cast<int>(*max_tokens);
  if (auto error = ReadNumber(body, "presence_penalty", -2.0, 2.0, false, out.presence_penalty)) {
    return error;
  }
  if (auto error = ReadNumber(body, "frequency_penalty", -2.0, 2.0, false, out.frequency_penalty)) {
    return error;
  }
  if (auto error = ReadLogitBias(body, out)) return error;
  if (auto error = ReadNumber(body, "repetition_penalty", 0.0, 2.0, /*low_open=*/true,
                              out.repetition_penalty)) {
    return error;
  }
  if (auto error = ReadBool(body, "ignore_eos", out.ignore_eos)) return error;
  if (auto error = ReadLogprobs(body, kind, out)) return error;
  const json& user = Field(body, "user");
  if (!user.is_null() && !user.is_string()) {
    return FieldError("user", "'user' must be a string, got " + Describe(user));
  }
  if (auto error = ReadNumber(body, "temperature", 0.0, 100.0, false, out.temperature)) {
    return error;
  }
  if (auto error = ReadNumber(body, "top_p", 0.0, 1.0, /*low_open=*/true, out.top_p)) {
    return error;
  }
  std::optional<int64_t> top_k;
  if (auto error = ReadInt(body, "top_k", -1, 1 << 30, top_k)) return error;
  if (top_k) out.top_k = *top_k < 0 ? 0 : static_cast<int>(*top_k);
  std::optional<int64_t> seed;
  if (auto error = ReadInt(body, "seed", std::numeric_limits<int64_t>::min(),
                           std::numeric_limits<int64_t>::max(), seed)) {
    return error;
  }
  if (seed) out.seed = static_cast<uint64_t>(*seed);
  if (auto error = ReadStop(body, out)) return error;
  if (auto error = ReadBool(body, "stream", out.stream)) return error;
  const json& stream_options = Field(body, "stream_options");
  if (!stream_options.is_null()) {
    if (!stream_options.is_object()) {
      return FieldError("stream_options",
                        "'stream_options' must be an object, got " + Describe(stream_options));
    }
    if (auto error = ReadBool(stream_options, "include_usage", out.include_usage)) {
      error->param = "stream_options.include_usage";
      return error;
    }
    for (const auto& [name, value] : stream_options.items()) {
      if (name != "include_usage" && !value.is_null()) {
        const std::string field = "stream_options." + KeyText(name);
        return FieldError(field, "'" + field + "' is not supported by rubato serve");
      }
    }
  }
  return std::nullopt;
}

json UsageJson(int prompt_tokens, int completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

namespace {

json Head(const CompletionResult& result, const char* object) {
  return {
      {"id", result.id}, {"object", object}, {"created", result.created}, {"model", result.model}};
}

json FinishReasonJson(std::string_view reason) {
  return reason.empty() ? json() : json(std::string(reason));
}

}  // namespace

json CompletionResponseJson(CompletionKind kind, const CompletionResult& result) {
  json choice = {{"index", 0}, {"finish_reason", FinishReasonJson(result.finish_reason)}};
  json response;
  if (kind == CompletionKind::kText) {
    response = Head(result, "text_completion");
    choice["text"] = result.text;
    choice["logprobs"] = result.logprobs;
  } else {
    response = Head(result, "chat.completion");
    choice["message"] = {{"role", "assistant"}, {"content", result.text}};
    if (!result.logprobs.is_null()) choice["logprobs"] = result.logprobs;
  }
  response["choices"] = json::array({choice});
  response["usage"] = UsageJson(result.prompt_tokens, result.completion_tokens);
  return response;
}

json CompletionChunkJson(CompletionKind kind, const CompletionResult& head, std::string_view text,
                         std::string_view finish_reason, bool first, const json& logprobs) {
  json choice = {{"index", 0}, {"finish_reason", FinishReasonJson(finish_reason)}};
  json chunk;
  if (kind == CompletionKind::kText) {
    chunk = Head(head, "text_completion");
    choice["text"] = std::string(text);
    choice["logprobs"] = logprobs;
  } else {
    if (!logprobs.is_null()) choice["logprobs"] = logprobs;
    chunk = Head(head, "chat.completion.chunk");
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || (first && finish_reason.empty())) delta["content"] = std::string(text);
    choice["delta"] = std::move(delta);
  }
  chunk["choices"] = json::array({choice});
  return chunk;
}

namespace {

// JSON has no -inf: OpenAI and vLLM report an impossible token's logprob as -9999.
float FiniteLogprob(float logprob) {
  return std::isnan(logprob) ? -9999.f : std::max(logprob, -9999.f);
}

}  // namespace

json CompletionLogprobsJson(const std::vector<TokenLogprobText>& tokens, size_t& text_offset) {
  json texts = json::array(), logprobs = json::array(), tops = json::array(),
       offsets = json::array();
  for (const TokenLogprobText& token : tokens) {
    texts.push_back(token.token);
    logprobs.push_back(FiniteLogprob(token.logprob));
    json top = json::object();
    for (const auto& [text, logprob] : token.top) top[text] = FiniteLogprob(logprob);
    top[token.token] = FiniteLogprob(token.logprob);
    tops.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += token.token.size();
  }
  return {{"tokens", std::move(texts)},
          {"token_logprobs", std::move(logprobs)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

json ChatLogprobsJson(const std::vector<TokenLogprobText>& tokens) {
  const auto bytes = [](const std::string& text) {
    json list = json::array();
    for (const char c : text) list.push_back(static_cast<unsigned char>(c));
    return list;
  };
  json content = json::array();
  for (const TokenLogprobText& token : tokens) {
    json top = json::array();
    for (const auto& [text, logprob] : token.top) {
      top.push_back({{"token", text}, {"logprob", FiniteLogprob(logprob)}, {"bytes", bytes(text)}});
    }
    content.push_back({{"token", token.token},
                       {"logprob", FiniteLogprob(token.logprob)},
                       {"bytes", bytes(token.token)},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

json UsageChunkJson(CompletionKind kind, const CompletionResult& result) {
  json chunk =
      Head(result, kind == CompletionKind::kText ? "text_completion" : "chat.completion.chunk");
  chunk["choices"] = json::array();
  chunk["usage"] = UsageJson(result.prompt_tokens, result.completion_tokens);
  return chunk;
}

json ModelJson(const std::string& model, int64_t created, int max_context) {
  return {
      {"id", model},   {"object", "model"}, {"created", created},          {"owned_by", "rubato"},
      {"root", model}, {"parent", nullptr}, {"max_model_len", max_context}};
}

json ModelListJson(const std::string& model, int64_t created, int max_context) {
  return {{"object", "list"}, {"data", json::array({ModelJson(model, created, max_context)})}};
}

std::string SseEvent(const json& payload) { return "data: " + DumpJson(payload) + "\n\n"; }

namespace {

// A text no model name or id holds (control characters): where the text goes in the event.
constexpr std::string_view kTextMark = "\x01\x02rubato-text\x02\x01";

// Appends `text` as a quoted JSON string, as DumpJson writes it (ensure_ascii off). Text with a
// byte >= 0x80 goes through DumpJson itself (invalid UTF-8 becomes U+FFFD there).
void AppendJsonString(std::string_view text, std::string& out) {
  for (const char c : text) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      out += DumpJson(json(std::string(text)));
      return;
    }
  }
  out += '"';
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          constexpr char kHex[] = "0123456789abcdef";
          out += "\\u00";
          out += kHex[(c >> 4) & 0xF];
          out += kHex[c & 0xF];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

}  // namespace

TextChunkEvents::TextChunkEvents(CompletionKind kind, const CompletionResult& head)
    : kind_(kind) {
  head_.id = head.id;
  head_.created = head.created;
  head_.model = head.model;
  const std::string event = SseEvent(CompletionChunkJson(kind, head_, kTextMark, "", false));
  std::string mark;
  AppendJsonString(kTextMark, mark);
  const size_t at = event.find(mark);
  if (at == std::string::npos || event.find(mark, at + 1) != std::string::npos) return;
  before_ = event.substr(0, at);
  after_ = event.substr(at + mark.size());
}

void TextChunkEvents::Append(std::string_view text, std::string& out) const {
  // A chat chunk without text has no delta.content: not the cut event's shape.
  if (before_.empty() || (text.empty() && kind_ == CompletionKind::kChat)) {
    out += SseEvent(CompletionChunkJson(kind_, head_, text, "", false));
    return;
  }
  out += before_;
  AppendJsonString(text, out);
  out += after_;
}

}  // namespace rubato::server
