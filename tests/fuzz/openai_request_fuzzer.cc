// libFuzzer target: the body of an HTTP request to /v1/completions or /v1/chat/completions
// through ParseCompletionRequest, as OpenAiRouter::Completion hands it over (no server). The
// first byte picks the endpoint (even: completions, odd: chat), the rest is the body. An error
// must become a valid JSON error body with a short message (a client's bytes are echoed as a
// short excerpt only); an accepted request's text goes through the response and stream-chunk
// JSON as the engine's output would. Seeds: corpus/openai_request.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "inference_rank/server/openai_api.h"

namespace {

using rubato::server::CompletionKind;

// The longest error message and `param`: fixed text around a few excerpts of 64 bytes.
constexpr size_t kMaxErrorMessageBytes = 512;
constexpr size_t kMaxErrorParamBytes = 128;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const CompletionKind kind = data[0] % 2 == 0 ? CompletionKind::kText : CompletionKind::kChat;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  rubato::server::CompletionRequest request;
  if (const auto error = rubato::server::ParseCompletionRequest(body, kind, request)) {
    const std::string reply = rubato::server::ApiErrorBody(*error);
    if (!nlohmann::json::accept(reply)) __builtin_trap();
    if (error->message.size() > kMaxErrorMessageBytes ||
        error->param.size() > kMaxErrorParamBytes) {
      __builtin_trap();
    }
    return 0;
  }
  rubato::server::CompletionResult result;
  result.id = "cmpl-fuzz";
  result.model = request.model.value_or("");
  result.text = request.prompt_text.value_or("");
  for (const rubato::ChatMessage& message : request.messages) result.text += message.content;
  for (const std::string& stop : request.stop) result.text += stop;
  result.finish_reason = "stop";
  const std::string response =
      rubato::server::DumpJson(rubato::server::CompletionResponseJson(kind, result));
  const std::string chunk = rubato::server::SseEvent(
      rubato::server::CompletionChunkJson(kind, result, result.text, "", /*first=*/true));
  if (!nlohmann::json::accept(response) || chunk.find("data: ") != 0) __builtin_trap();
  return 0;
}
