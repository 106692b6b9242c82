// The reply side of `rubato bench serve`: a Server-Sent Events splitter fed the body of a
// streamed OpenAI reply in pieces of any size (an event may be cut at any byte, across HTTP
// chunks or reads), and the reading of one event's data as an OpenAI completion or chat chunk.
// Neither throws nor keeps more than one event: an event longer than the bound, or JSON of an
// unexpected shape, is an error value naming what was wrong. No sockets here (tests/fuzz links
// it alone: bench_sse_fuzzer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace rubato::bench {

// Splits a text/event-stream (the WHATWG rules: lines end with CRLF, LF or CR; "data:" fields,
// one optional space after the colon, several joined by LF; a blank line ends an event; lines
// starting with ':' are comments; other fields are skipped) into the data of each event.
class SseSplitter {
 public:
  // An event (its field lines together) longer than `max_event_bytes` is an error.
  explicit SseSplitter(size_t max_event_bytes) : max_event_bytes_(max_event_bytes) {}

  // Appends the data of every event `bytes` completes to `events`. False once an event outgrew
  // the bound (error() says so); later calls then do nothing.
  bool Feed(std::string_view bytes, std::vector<std::string>& events);
  // The stream ended: an event its last blank line did not close is still dispatched (a server
  // that closes right after "data: [DONE]\n"). False after an error.
  bool Finish(std::vector<std::string>& events);

  const std::string& error() const { return error_; }

 private:
  void EndLine(std::vector<std::string>& events);

  size_t max_event_bytes_;
  std::string line_;        // the current line, without its end
  std::string data_;        // the data fields of the current event, joined by LF
  size_t event_bytes_ = 0;  // bytes of the current event's lines so far
  bool has_data_ = false;   // a data field was seen (data may be empty)
  bool after_cr_ = false;   // the last byte was CR: an LF right after it ends nothing more
  std::string error_;
};

enum class StreamApi { kCompletions, kChat };

// What one event of a streamed /v1/completions or /v1/chat/completions reply says.
struct StreamEvent {
  enum class Kind {
    kChoice,   // a chunk with choices[0] (a token, or text that may be empty): timed
    kUsage,    // the usage-only chunk (stream_options.include_usage)
    kDone,     // "[DONE]"
    kIgnored,  // valid, says nothing timed (no choices, no usage)
    kError,    // an error event or an unexpected shape: the request fails with `error`
  };
  Kind kind = Kind::kIgnored;
  std::string text;                // kChoice: choices[0].text or .delta.content ("" if null)
  int64_t prompt_tokens = -1;      // usage.prompt_tokens when the event carries it
  int64_t completion_tokens = -1;  // usage.completion_tokens when the event carries it
  std::string error;               // kError: short, with at most a 64-byte excerpt of the event
};

StreamEvent ReadStreamEvent(std::string_view data, StreamApi api);

// `text` if short, else its first `max_bytes` bytes (cut on a UTF-8 boundary) and "...".
std::string Excerpt(std::string_view text, size_t max_bytes = 64);

}  // namespace rubato::bench
