// libFuzzer target: the body of a streamed OpenAI reply through `rubato bench serve`'s SSE
// splitter and stream-chunk reader (inference_rank/cli/bench_serve_sse.h), as the load generator
// feeds them. Byte 0 picks the API (even: completions, odd: chat), bytes 1-2 a cut position, the
// rest is the stream. The stream fed whole, cut in two at that position and fed in 7-byte pieces
// must give the same events (or the same error); no event may exceed the bound; every event's
// reading must return (no exception) with a short error message. Seeds: corpus/bench_sse.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "inference_rank/cli/bench_serve_sse.h"

namespace {

using rubato::bench::SseSplitter;
using rubato::bench::StreamApi;
using rubato::bench::StreamEvent;

constexpr size_t kMaxEventBytes = 4096;
// "error event: " and an excerpt of 300 bytes, or fixed text around a 64-byte excerpt.
constexpr size_t kMaxErrorBytes = 400;

struct Split {
  std::vector<std::string> events;
  bool ok = true;
};

Split Feed(const std::vector<std::string_view>& pieces) {
  SseSplitter splitter(kMaxEventBytes);
  Split out;
  for (std::string_view piece : pieces) out.ok = splitter.Feed(piece, out.events) && out.ok;
  out.ok = splitter.Finish(out.events) && out.ok;
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const StreamApi api = data[0] % 2 == 0 ? StreamApi::kCompletions : StreamApi::kChat;
  const std::string_view stream(reinterpret_cast<const char*>(data) + 3, size - 3);
  const size_t cut = (size_t{data[1]} << 8 | data[2]) % (stream.size() + 1);

  const Split whole = Feed({stream});
  const Split halves = Feed({stream.substr(0, cut), stream.substr(cut)});
  std::vector<std::string_view> pieces;
  for (size_t at = 0; at < stream.size(); at += 7) pieces.push_back(stream.substr(at, 7));
  const Split small = Feed(pieces);
  if (whole.ok != halves.ok || whole.ok != small.ok || whole.events != halves.events ||
      whole.events != small.events) {
    __builtin_trap();
  }
  for (const std::string& event : whole.events) {
    if (event.size() > kMaxEventBytes) __builtin_trap();
    const StreamEvent read = rubato::bench::ReadStreamEvent(event, api);
    if (read.kind == StreamEvent::Kind::kError &&
        (read.error.empty() || read.error.size() > kMaxErrorBytes)) {
      __builtin_trap();
    }
    if (read.kind != StreamEvent::Kind::kError && !read.error.empty()) __builtin_trap();
  }
  return 0;
}
