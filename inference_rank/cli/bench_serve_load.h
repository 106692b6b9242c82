// The load generator of `rubato bench serve`: every request of a run on one Boost.Asio
// io_context in the calling thread (no thread per request, so none can fail to start), each over
// its own Boost.Beast HTTP/1.1 connection with one deadline for the whole exchange, the reply
// body read in pieces (chunked, Content-Length or until close) and passed through the SSE
// splitter without being kept. Arrivals follow a precomputed schedule; at most max_concurrency
// requests are in flight and the others wait in arrival order.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "inference_rank/cli/bench_serve_sse.h"

namespace rubato::bench {

using Clock = std::chrono::steady_clock;

// Where the requests go: host, port and the path every target starts with (a --base-url's path).
struct ServerAddress {
  std::string host;
  std::string port;
  std::string path_prefix;  // "" or "/prefix" (no trailing slash)
};

// Bounds on one exchange.
struct ExchangeLimits {
  Clock::duration request_timeout;  // connect to the last byte of the reply
  uint64_t max_reply_bytes;         // the reply body, at most
  size_t max_event_bytes;           // one SSE event, at most
};

// What one streamed request measured (the fields of vLLM's RequestFuncOutput).
struct RequestOutcome {
  bool success = false;
  std::string error;
  double start_time = 0;       // seconds after the run's start, when it was sent
  double queue_time = 0;       // seconds it waited for --max-concurrency
  double ttft = 0;             // seconds to the first event with choices
  double latency = 0;          // seconds to the last event with choices
  std::vector<double> itl;     // seconds between events with choices after the first
  int64_t prompt_len = 0;      // the prompt's length, or usage.prompt_tokens when sent
  int64_t output_tokens = 0;   // usage.completion_tokens, or the number of events with choices
  std::string generated_text;  // kept only when asked (--save-detailed)
};

// The run: request i is due at arrival_s[i] seconds after the start and sent as the body
// make_body(i) builds at that moment (so only requests in flight hold a body).
struct LoadPlan {
  ServerAddress server;
  std::string target;  // path prefix + endpoint
  StreamApi api = StreamApi::kCompletions;
  std::vector<double> arrival_s;
  std::function<std::string(size_t)> make_body;
  std::function<int64_t(size_t)> prompt_len;  // the prompt length reported without usage
  int max_concurrency = 0;                    // 0: no limit
  ExchangeLimits limits;
  Clock::duration run_timeout;  // from the start; requests not done by then fail
  bool keep_text = false;
  std::function<void(size_t done, size_t total)> on_progress;  // may be empty
};

struct LoadResult {
  std::vector<RequestOutcome> outcomes;  // in request order
  double duration_s = 0;                 // the start to the last request's end
  bool run_deadline_passed = false;      // some request failed for the run's deadline
};

// Runs the plan; fails only when the address cannot be resolved (per-request errors are
// outcomes).
Result<LoadResult> RunLoad(const LoadPlan& plan);

// GET `path` (prefixed) with the same deadline and a 1 MiB bound: the body of a 200 reply.
Result<std::string> FetchBody(const ServerAddress& server, const std::string& path,
                              Clock::duration timeout);

}  // namespace rubato::bench
