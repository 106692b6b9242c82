// The load generator of `rubato bench serve` (see bench_serve_load.h): Exchange is one HTTP
// request and its reply on a Beast tcp_stream under one absolute deadline; LoadRunner schedules
// the arrivals, the concurrency limit and the outcomes.
//
// GCC 12 with -fsanitize=address warns maybe-uninitialized inside Boost.Beast's own parser, a
// false positive (see inference_rank/server/http_server.cc); the pragma precedes every include.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "inference_rank/cli/bench_serve_load.h"

#include <algorithm>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdlib>
#include <deque>
#include <memory>
#include <utility>

namespace rubato::bench {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

constexpr size_t kHeaderLimit = 16 << 10;  // a reply's status line and headers, at most
constexpr size_t kErrorBodyBytes = 300;    // what a non-200 reply's body contributes to errors
constexpr uint64_t kFetchLimit = 1 << 20;  // a GET reply (the model list), at most

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// What the body sink tells the exchange after a piece of the body.
enum class SinkVerdict { kMore, kComplete, kFailed };

// One HTTP exchange: connect, send, read the reply header, then the body in pieces passed to
// the sink as they arrive. Every step runs under the same absolute deadline.
class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  using Sink = std::function<SinkVerdict(std::string_view, Clock::time_point, std::string&)>;
  // error is empty when the reply was 200 and the sink completed (or the body ended); timed_out
  // says the deadline ended it.
  using Done = std::function<void(const std::string& error, bool timed_out)>;

  Exchange(net::io_context& io, const tcp::resolver::results_type& endpoints,
           http::request<http::string_body> request, Clock::time_point deadline,
           std::string deadline_message, uint64_t max_body_bytes, Sink sink, Done done)
      : stream_(io),
        endpoints_(endpoints),
        request_(std::move(request)),
        deadline_(deadline),
        deadline_message_(std::move(deadline_message)),
        max_body_bytes_(max_body_bytes),
        buffer_(kHeaderLimit * 2),
        sink_(std::move(sink)),
        done_(std::move(done)) {
    parser_.header_limit(kHeaderLimit);
    parser_.body_limit(max_body_bytes);
  }

  void Start() {
    stream_.expires_at(deadline_);
    stream_.async_connect(endpoints_, [self = shared_from_this()](beast::error_code ec,
                                                                  const tcp::endpoint&) {
      if (ec) return self->Fail(ec, "cannot connect");
      self->stream_.expires_at(self->deadline_);
      http::async_write(self->stream_, self->request_,
                        [self](beast::error_code write_ec, size_t) { self->OnWrite(write_ec); });
    });
  }

 private:
  void OnWrite(beast::error_code ec) {
    if (ec) return Fail(ec, "the request could not be sent");
    request_ = {};  // the body is not needed any more
    stream_.expires_at(deadline_);
    http::async_read_header(stream_, buffer_, parser_,
                            [self = shared_from_this()](beast::error_code read_ec, size_t) {
                              if (read_ec) return self->Fail(read_ec, "no valid reply header");
                              self->status_ = self->parser_.get().result_int();
                              if (self->parser_.is_done()) return self->EndOfBody();
                              self->ReadSome();
                            });
  }

  void ReadSome() {
    http::buffer_body::value_type& body = parser_.get().body();
    body.data = piece_;
    body.size = sizeof(piece_);
    stream_.expires_at(deadline_);
    http::async_read_some(
        stream_, buffer_, parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(beast::error_code ec) {
    if (ec == http::error::need_buffer) ec = {};
    const size_t produced = sizeof(piece_) - parser_.get().body().size;
    const std::string_view bytes(piece_, produced);
    if (status_ != 200) {
      error_body_.append(bytes.substr(0, kErrorBodyBytes - error_body_.size()));
      if (ec || parser_.is_done() || error_body_.size() >= kErrorBodyBytes) return EndOfBody();
      return ReadSome();
    }
    if (!bytes.empty()) {
      std::string error;
      switch (sink_(bytes, Clock::now(), error)) {
        case SinkVerdict::kMore:
          break;
        case SinkVerdict::kComplete:
          return Finish("", false);
        case SinkVerdict::kFailed:
          return Finish(error, false);
      }
    }
    if (ec) return Fail(ec, "the reply broke off");
    if (parser_.is_done()) return EndOfBody();
    ReadSome();
  }

  void EndOfBody() {
    if (status_ != 200) {
      const auto& header = parser_.get();
      return Finish("HTTP " + std::to_string(status_) + " " + std::string(header.reason()) +
                        (error_body_.empty() ? "" : ": " + Excerpt(error_body_, kErrorBodyBytes)),
                    false);
    }
    std::string error;
    const SinkVerdict verdict = sink_({}, Clock::now(), error);  // empty: the body ended
    Finish(verdict == SinkVerdict::kFailed ? error : "", false);
  }

  void Fail(beast::error_code ec, const std::string& what) {
    if (ec == beast::error::timeout) return Finish(deadline_message_, true);
    if (ec == http::error::body_limit) {
      return Finish("a reply body larger than " + std::to_string(max_body_bytes_) +
                        " bytes (--max-reply-bytes)",
                    false);
    }
    if (ec == http::error::header_limit) {
      return Finish("a reply header larger than " + std::to_string(kHeaderLimit) + " bytes", false);
    }
    Finish(what + ": " + ec.message(), false);
  }

  void Finish(const std::string& error, bool timed_out) {
    if (finished_) return;
    finished_ = true;
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
    done_(error, timed_out);
  }

  beast::tcp_stream stream_;
  tcp::resolver::results_type endpoints_;
  http::request<http::string_body> request_;
  Clock::time_point deadline_;
  std::string deadline_message_;
  uint64_t max_body_bytes_;
  beast::flat_buffer buffer_;  // bytes read past what the parser consumed; bounded
  http::response_parser<http::buffer_body> parser_;
  char piece_[16 << 10];  // the body as read, handed to the sink
  unsigned status_ = 0;
  std::string error_body_;  // a non-200 reply's first bytes
  Sink sink_;
  Done done_;
  bool finished_ = false;
};

http::request<http::string_body> MakeRequest(http::verb verb, const ServerAddress& server,
                                             const std::string& target, std::string body) {
  http::request<http::string_body> request{verb, target, 11};
  request.set(http::field::host, server.host + ":" + server.port);
  request.set(http::field::user_agent, "rubato-bench-serve");
  // As vllm bench serve: a key in OPENAI_API_KEY goes to the server as a bearer token.
  if (const char* key = std::getenv("OPENAI_API_KEY"); key != nullptr && *key != '\0') {
    request.set(http::field::authorization, std::string("Bearer ") + key);
  }
  if (verb == http::verb::post) request.set(http::field::content_type, "application/json");
  request.keep_alive(false);
  request.body() = std::move(body);
  request.prepare_payload();
  return request;
}

Result<tcp::resolver::results_type> Resolve(net::io_context& io, const ServerAddress& server) {
  tcp::resolver resolver(io);
  beast::error_code ec;
  // Synchronous: asio's asynchronous resolver would start a thread.
  auto endpoints = resolver.resolve(server.host, server.port, ec);
  if (ec) {
    return UnavailableError("bench serve: cannot resolve " + server.host + ":" + server.port +
                            ": " + ec.message());
  }
  return endpoints;
}

// Schedules the plan's requests on one io_context (see bench_serve_load.h).
class LoadRunner {
 public:
  LoadRunner(const LoadPlan& plan, tcp::resolver::results_type endpoints, net::io_context& io)
      : plan_(plan), endpoints_(std::move(endpoints)), io_(io), timer_(io) {
    result_.outcomes.resize(plan.arrival_s.size());
    arrived_at_.resize(plan.arrival_s.size());
  }

  LoadResult Run() {
    start_ = Clock::now();
    last_end_ = start_;
    run_deadline_ = start_ + plan_.run_timeout;
    ScheduleArrivals();
    io_.run();
    result_.duration_s = Seconds(last_end_ - start_);
    return std::move(result_);
  }

 private:
  size_t total() const { return plan_.arrival_s.size(); }

  Clock::time_point Due(size_t i) const {
    return start_ + std::chrono::duration_cast<Clock::duration>(
                        std::chrono::duration<double>(plan_.arrival_s[i]));
  }

  void ScheduleArrivals() {
    while (next_ < total()) {
      const Clock::time_point due = Due(next_);
      if (due >= run_deadline_) {  // never sent: the run ends first
        for (; next_ < total(); ++next_) {
          result_.outcomes[next_].error = RunDeadlineMessage("before it was due");
          Finished(next_, true);
        }
        return;
      }
      if (due > Clock::now()) {
        timer_.expires_at(due);
        timer_.async_wait([this](beast::error_code) { ScheduleArrivals(); });
        return;
      }
      Arrive(next_++);
    }
  }

  std::string RunDeadlineMessage(const char* when) const {
    return std::string("the run's deadline (--run-timeout ") +
           std::to_string(
               std::chrono::duration_cast<std::chrono::seconds>(plan_.run_timeout).count()) +
           " s) passed " + when;
  }

  void Arrive(size_t i) {
    arrived_at_[i] = Clock::now();
    if (plan_.max_concurrency == 0 || in_flight_ < plan_.max_concurrency) {
      Send(i);
    } else {
      waiting_.push_back(i);
    }
  }

  void Send(size_t i) {
    const Clock::time_point now = Clock::now();
    RequestOutcome& outcome = result_.outcomes[i];
    outcome.start_time = Seconds(now - start_);
    outcome.queue_time = Seconds(now - arrived_at_[i]);
    outcome.prompt_len = plan_.prompt_len(i);
    if (now >= run_deadline_) {
      outcome.error = RunDeadlineMessage("while it waited for --max-concurrency");
      return Finished(i, true);
    }
    ++in_flight_;
    const Clock::time_point request_deadline = now + plan_.limits.request_timeout;
    const bool run_first = run_deadline_ < request_deadline;
    const std::string deadline_message =
        run_first ? RunDeadlineMessage("before the reply ended")
                  : "no complete reply within --request-timeout " +
                        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                                           plan_.limits.request_timeout)
                                           .count()) +
                        " s";
    auto stream = std::make_shared<StreamState>(plan_.limits.max_event_bytes);
    auto sink = [this, i, now, stream](std::string_view bytes, Clock::time_point at,
                                       std::string& error) {
      return Consume(*stream, result_.outcomes[i], now, bytes, at, error);
    };
    auto done = [this, i, stream, run_first](const std::string& error, bool timed_out) {
      RequestOutcome& done_outcome = result_.outcomes[i];
      done_outcome.error = error;
      if (error.empty() && !(stream->done && stream->choices > 0)) {
        done_outcome.error = stream->choices == 0 ? "the stream held no event with choices"
                                                  : "the stream ended without data: [DONE]";
      }
      done_outcome.success = done_outcome.error.empty();
      if (done_outcome.success && stream->completion_tokens < 0) {
        done_outcome.output_tokens = stream->choices;  // no usage: one token per event
      }
      if (!done_outcome.success) done_outcome.itl.clear();
      --in_flight_;
      Finished(i, timed_out && run_first);
      while (!waiting_.empty() &&
             (plan_.max_concurrency == 0 || in_flight_ < plan_.max_concurrency)) {
        const size_t waiting = waiting_.front();
        waiting_.pop_front();
        Send(waiting);
      }
    };
    std::make_shared<Exchange>(
        io_, endpoints_,
        MakeRequest(http::verb::post, plan_.server, plan_.target, plan_.make_body(i)),
        run_first ? run_deadline_ : request_deadline, deadline_message,
        plan_.limits.max_reply_bytes, std::move(sink), std::move(done))
        ->Start();
  }

  // The SSE state of one request in flight.
  struct StreamState {
    explicit StreamState(size_t max_event_bytes) : splitter(max_event_bytes) {}
    SseSplitter splitter;
    std::vector<std::string> events;  // reused between pieces
    int64_t choices = 0;
    int64_t completion_tokens = -1;
    bool done = false;
    Clock::time_point last;
  };

  // Times the events `bytes` completes (empty bytes: the body ended).
  SinkVerdict Consume(StreamState& stream, RequestOutcome& outcome, Clock::time_point sent,
                      std::string_view bytes, Clock::time_point at, std::string& error) {
    stream.events.clear();
    const bool ok = bytes.empty() ? stream.splitter.Finish(stream.events)
                                  : stream.splitter.Feed(bytes, stream.events);
    if (!ok) {
      error = stream.splitter.error();
      return SinkVerdict::kFailed;
    }
    for (const std::string& data : stream.events) {
      const StreamEvent event = ReadStreamEvent(data, plan_.api);
      if (event.prompt_tokens >= 0) outcome.prompt_len = event.prompt_tokens;
      if (event.completion_tokens >= 0) {
        stream.completion_tokens = event.completion_tokens;
        outcome.output_tokens = event.completion_tokens;
      }
      switch (event.kind) {
        case StreamEvent::Kind::kChoice:
          if (stream.choices++ == 0) {
            outcome.ttft = Seconds(at - sent);
          } else {
            outcome.itl.push_back(Seconds(at - stream.last));
          }
          stream.last = at;
          outcome.latency = Seconds(at - sent);
          if (plan_.keep_text) outcome.generated_text += event.text;
          break;
        case StreamEvent::Kind::kDone:
          stream.done = true;
          return SinkVerdict::kComplete;
        case StreamEvent::Kind::kError:
          error = event.error;
          return SinkVerdict::kFailed;
        case StreamEvent::Kind::kUsage:
        case StreamEvent::Kind::kIgnored:
          break;
      }
    }
    return SinkVerdict::kMore;
  }

  void Finished(size_t i, bool run_deadline) {
    if (run_deadline) result_.run_deadline_passed = true;
    last_end_ = Clock::now();
    ++finished_;
    if (plan_.on_progress) plan_.on_progress(finished_, total());
  }

  const LoadPlan& plan_;
  tcp::resolver::results_type endpoints_;
  net::io_context& io_;
  net::steady_timer timer_;
  LoadResult result_;
  std::vector<Clock::time_point> arrived_at_;
  std::deque<size_t> waiting_;  // arrived, waiting for --max-concurrency, in arrival order
  Clock::time_point start_;
  Clock::time_point last_end_;
  Clock::time_point run_deadline_;
  size_t next_ = 0;  // the next request to arrive
  int in_flight_ = 0;
  size_t finished_ = 0;
};

}  // namespace

Result<LoadResult> RunLoad(const LoadPlan& plan) {
  net::io_context io(1);
  RUBATO_ASSIGN_OR_RETURN(auto endpoints, Resolve(io, plan.server));
  LoadRunner runner(plan, std::move(endpoints), io);
  return runner.Run();
}

Result<std::string> FetchBody(const ServerAddress& server, const std::string& path,
                              Clock::duration timeout) {
  net::io_context io(1);
  RUBATO_ASSIGN_OR_RETURN(auto endpoints, Resolve(io, server));
  std::string body;
  std::string failure;
  auto sink = [&body](std::string_view bytes, Clock::time_point, std::string&) {
    body.append(bytes);
    return SinkVerdict::kMore;
  };
  auto done = [&failure](const std::string& error, bool) { failure = error; };
  const std::string target = server.path_prefix + path;
  std::make_shared<Exchange>(io, endpoints, MakeRequest(http::verb::get, server, target, ""),
                             Clock::now() + timeout, "no complete reply within --request-timeout",
                             kFetchLimit, std::move(sink), std::move(done))
      ->Start();
  io.run();
  if (!failure.empty()) {
    return UnavailableError("bench serve: GET " + target + " on " + server.host + ":" +
                            server.port + ": " + failure);
  }
  return body;
}

}  // namespace rubato::bench
