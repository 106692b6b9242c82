// `rubato generate`'s token loop (see generate_stream.h).
#include "inference_rank/cli/generate_stream.h"

#include <string>
#include <vector>

namespace rubato {
namespace {

// One write and one flush for what a step produced (nothing when it produced no text).
void Emit(std::string& text, std::FILE* out) {
  if (text.empty()) return;
  std::fwrite(text.data(), 1, text.size(), out);
  std::fflush(out);
  text.clear();
}

}  // namespace

Status StreamGeneratedTokens(Engine& engine, StreamDecoder* decoder, std::FILE* out,
                             std::chrono::steady_clock::time_point start,
                             GenerateStreamStats& stats) {
  stats.first_token = start;
  stats.last_token = start;
  std::string text;  // this step's, reused
  while (engine.HasWork()) {
    RUBATO_ASSIGN_OR_RETURN(std::vector<TokenEvent> events, engine.Step());
    for (const TokenEvent& event : events) {
      if (event.finish == FinishReason::kError) {
        if (decoder) text += decoder->Flush();
        text += "\n";
        Emit(text, out);
        return event.error;
      }
      stats.retained_kv_sum += event.retained_kv_ratio;
      stats.last_token = std::chrono::steady_clock::now();
      if (stats.generated++ == 0) stats.first_token = stats.last_token;
      if (event.finish == FinishReason::kStop) continue;
      if (decoder) {
        decoder->PushTo(event.token, &text);
      } else {
        text += std::to_string(event.token);
        text += ' ';
      }
    }
    Emit(text, out);
  }
  if (decoder) text += decoder->Flush();
  Emit(text, out);
  return Status::Ok();
}

}  // namespace rubato
