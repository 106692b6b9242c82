// The SSE splitter and the OpenAI stream-chunk reader of `rubato bench serve` (see
// bench_serve_sse.h). JSON is parsed without exceptions and every field's type is checked before
// it is read, so no reply can throw out of here.
#include "inference_rank/cli/bench_serve_sse.h"

#include <nlohmann/json.hpp>

namespace rubato::bench {
namespace {

using nlohmann::json;

// The largest count a usage field may hold: what a double represents exactly.
constexpr int64_t kMaxTokenCount = int64_t{1} << 53;

StreamEvent Failed(std::string error) {
  StreamEvent event;
  event.kind = StreamEvent::Kind::kError;
  event.error = std::move(error);
  return event;
}

// Reads usage.prompt_tokens / completion_tokens into `event`; false (and event.error) when
// usage is not an object of non-negative integers. A null usage is no usage.
bool ReadUsage(const json& chunk, StreamEvent& event) {
  const auto usage = chunk.find("usage");
  if (usage == chunk.end() || usage->is_null()) return true;
  if (!usage->is_object()) {
    event = Failed("an event's usage is not an object");
    return false;
  }
  for (const auto& [name, out] : {std::pair{"prompt_tokens", &event.prompt_tokens},
                                  std::pair{"completion_tokens", &event.completion_tokens}}) {
    const auto field = usage->find(name);
    if (field == usage->end() || field->is_null()) continue;
    // JSON parses a non-negative integer as unsigned, a negative one as signed.
    if (!field->is_number_unsigned() || field->get<uint64_t>() > uint64_t{kMaxTokenCount}) {
      event = Failed(std::string("an event's usage.") + name +
                     " is not an integer in [0, 2^53]: " + Excerpt(field->dump()));
      return false;
    }
    *out = static_cast<int64_t>(field->get<uint64_t>());
  }
  return true;
}

}  // namespace

std::string Excerpt(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t end = max_bytes;
  // Back up over UTF-8 continuation bytes (10xxxxxx) so a character is not cut.
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return std::string(text.substr(0, end)) + "...";
}

void SseSplitter::EndLine(std::vector<std::string>& events) {
  if (line_.empty()) {  // a blank line: dispatch
    if (has_data_) events.push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    event_bytes_ = 0;
    return;
  }
  if (line_[0] != ':') {
    const size_t colon = line_.find(':');
    const std::string_view name = std::string_view(line_).substr(0, colon);
    if (name == "data") {
      std::string_view value;
      if (colon != std::string::npos) {
        value = std::string_view(line_).substr(colon + 1);
        if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
      }
      if (has_data_) data_ += '\n';
      data_ += value;
      has_data_ = true;
    }
  }
  line_.clear();
}

bool SseSplitter::Feed(std::string_view bytes, std::vector<std::string>& events) {
  if (!error_.empty()) return false;
  for (const char c : bytes) {
    if (c == '\n' && after_cr_) {  // the LF of a CRLF whose CR already ended the line
      after_cr_ = false;
      continue;
    }
    after_cr_ = c == '\r';
    if (c == '\n' || c == '\r') {
      EndLine(events);
      continue;
    }
    if (++event_bytes_ > max_event_bytes_) {
      error_ = "an SSE event longer than " + std::to_string(max_event_bytes_) + " bytes";
      line_.clear();
      data_.clear();
      return false;
    }
    line_ += c;
  }
  return true;
}

bool SseSplitter::Finish(std::vector<std::string>& events) {
  if (!error_.empty()) return false;
  if (!line_.empty()) EndLine(events);
  if (has_data_) events.push_back(std::move(data_));
  data_.clear();
  has_data_ = false;
  return true;
}

StreamEvent ReadStreamEvent(std::string_view data, StreamApi api) {
  StreamEvent event;
  if (data == "[DONE]") {
    event.kind = StreamEvent::Kind::kDone;
    return event;
  }
  const json chunk = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (chunk.is_discarded()) return Failed("an event is not JSON: " + Excerpt(data));
  if (!chunk.is_object()) return Failed("an event is not a JSON object: " + Excerpt(data));
  if (const auto error = chunk.find("error"); error != chunk.end()) {
    if (error->is_object()) {
      const auto message = error->find("message");
      if (message != error->end() && message->is_string()) {
        return Failed("error event: " + Excerpt(message->get_ref<const std::string&>(), 300));
      }
    }
    return Failed("error event: " + Excerpt(data));
  }
  if (!ReadUsage(chunk, event)) return event;
  const auto choices = chunk.find("choices");
  if (choices != chunk.end() && !choices->is_null()) {
    if (!choices->is_array()) return Failed("an event's choices is not an array");
    if (!choices->empty()) {
      const json& choice = (*choices)[0];
      if (!choice.is_object()) return Failed("an event's choices[0] is not an object");
      const json* holder = &choice;
      const char* field = "text";
      if (api == StreamApi::kChat) {
        const auto delta = choice.find("delta");
        if (delta == choice.end() || !delta->is_object()) {
          return Failed("an event's choices[0].delta is not an object");
        }
        holder = &*delta;
        field = "content";
      }
      const auto text = holder->find(field);
      if (text != holder->end() && !text->is_null()) {
        if (!text->is_string()) {
          return Failed(std::string("an event's choices[0].") +
                        (api == StreamApi::kChat ? "delta.content" : "text") +
                        " is not a string: " + Excerpt(text->dump()));
        }
        event.text = text->get<std::string>();
      }
      event.kind = StreamEvent::Kind::kChoice;
      return event;
    }
  }
  if (event.prompt_tokens >= 0 || event.completion_tokens >= 0) {
    event.kind = StreamEvent::Kind::kUsage;
  }
  return event;
}

}  // namespace rubato::bench
