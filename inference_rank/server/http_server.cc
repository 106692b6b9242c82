// The HTTP/1.1 connection handling of `rubato serve` (see http_server.h): an acceptor and one
// Session per connection, all on one io_context thread.
//
// GCC 12 with -fsanitize=address warns maybe-uninitialized inside Boost.Beast's own parser
// (boost::optional<size_t> returned as boost::none in basic_parser::content_length_unchecked), a
// false positive that -Werror turns into a failed sanitizer build. The pragma precedes every
// include because the warning is reported at header locations.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "inference_rank/server/http_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <exception>
#include <future>
#include <optional>
#include <set>
#include <utility>

#include "common/accept_retry.h"
#include "common/heap_trim.h"
#include "common/logging.h"
#include "inference_rank/server/openai_api.h"
#include "inference_rank/server/request_id.h"

namespace rubato::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {
constexpr const char* kLogSubsystem = "http";
// Bytes a connection reads ahead while its reply is pending (a pipelined next request), at most.
constexpr size_t kReadAheadBytes = 64 << 10;
// The interim response that probes a half-closed HTTP/1.1 client (see Session::OnPeerEof).
constexpr std::string_view kProbe = "HTTP/1.1 100 Continue\r\n\r\n";

// True when the peer of a connected TCP socket has reset it: what a peer that closed its socket
// answers to bytes sent to it.
bool PeerReset(int fd) {
  int error = 0;
  socklen_t length = sizeof(error);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error != 0) return true;
  tcp_info info{};
  length = sizeof(info);
  return ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) == 0 &&
         info.tcpi_state == TCP_CLOSE;
}
}  // namespace

// ---- Session --------------------------------------------------------------------------------

class Session;

struct HttpServer::State {
  net::io_context io;
  // Keeps io.run() going when no connection or accept is left (a stopped listener), until Stop.
  net::executor_work_guard<net::io_context::executor_type> keep_running{io.get_executor()};
  tcp::acceptor acceptor{io};
  HttpServerOptions options;
  HttpHandler handler;
  std::set<std::shared_ptr<Session>> sessions;  // I/O thread only
  bool stopping = false;                       // I/O thread only
  std::weak_ptr<State> self;  // for notifications that may outlive the server
  std::atomic<int> open_sessions{0};
  std::atomic<int> pending_replies{0};
  // Failed accepts (descriptors exhausted) back off instead of spinning (common/accept_retry.h).
  // I/O thread only.
  net::steady_timer accept_backoff{io};
  AcceptRetry accept_retry;
};

namespace {

std::string StatusLine(int status) {
  return std::to_string(status) + " " +
         std::string(http::obsolete_reason(static_cast<http::status>(status)));
}

std::string ChunkOf(const std::string& data) {
  char size[32];
  std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
  return size + data + "\r\n";
}

std::string JsonError(int status, const std::string& message, const std::string& type) {
  ApiError error;
  error.http_status = status;
  error.message = message;
  error.type = type;
  return ApiErrorBody(error);
}

}  // namespace

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::State* state)
      : stream_(std::move(socket)), state_(state) {
    ++state_->open_sessions;
  }
  ~Session() { --state_->open_sessions; }

  void Run() { ReadHeader(); }

  // Server stop: a connection waiting for its next request closes now; one that has begun a
  // request (bytes of it arrived, read or not), or has a reply to write, closes after that reply.
  void CloseIfIdle() {
    beast::error_code error;
    const bool bytes_arrived = buffer_.size() > 0 || stream_.socket().available(error) > 0 ||
                               (parser_ && parser_->got_some());
    if (waiting_for_request_ && !bytes_arrived) Close();
  }
  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

 private:
  void ReadHeader() {
    head_only_ = false;
    if (state_->stopping) {
      Close();
      return Forget();
    }
    waiting_for_request_ = true;
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(state_->options.max_header_bytes));
    parser_->body_limit(state_->options.max_body_bytes);
    stream_.expires_after(state_->options.idle_timeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code error, size_t) {
                              self->OnHeader(error);
                            });
  }

  void OnHeader(beast::error_code error) {
    waiting_for_request_ = false;
    if (error) return OnReadError(error);
    const auto& header = parser_->get();
    if (beast::iequals(header[http::field::expect], "100-continue")) {
      auto interim = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      net::async_write(stream_, net::buffer(*interim),
                       [self = shared_from_this(), interim](beast::error_code error, size_t) {
                         if (error) return self->Forget();
                         self->ReadBody();
                       });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code error, size_t) {
                       if (error) return self->OnReadError(error);
                       self->OnRequest();
                     });
  }

  void OnReadError(beast::error_code error) {
    if (error == http::error::end_of_stream || error == beast::error::timeout ||
        error == net::error::operation_aborted || error == net::error::connection_reset ||
        error == net::error::eof) {
      Close();
      return Forget();
    }
    // These replies never reach the router: they carry the x-request-id it would have given
    // (the client's when its headers were read and it sent a valid one).
    if (error == http::error::body_limit) {
      const auto& header = parser_->get();
      const auto sent = header.find("x-request-id");
      const std::string id = EchoedRequestId(
          sent == header.end() ? std::string_view()
                               : std::string_view(sent->value().data(), sent->value().size()));
      return WriteWhole(413, "application/json",
                        JsonError(413, "the request body is larger than the server's limit of " +
                                           std::to_string(state_->options.max_body_bytes) +
                                           " bytes", "invalid_request_error"),
                        /*keep_alive=*/false, {{"x-request-id", id}});
    }
    if (error == http::error::header_limit) {
      return WriteWhole(431, "application/json",
                        JsonError(431, "the request line and headers are larger than the "
                                       "server's limit of " +
                                           std::to_string(state_->options.max_header_bytes) +
                                           " bytes", "invalid_request_error"),
                        false, {{"x-request-id", NewRequestId()}});
    }
    if (error.category() == http::make_error_code(http::error::bad_method).category()) {
      return WriteWhole(400, "application/json",
                        JsonError(400, "malformed HTTP request: " + error.message(),
                                  "invalid_request_error"),
                        false, {{"x-request-id", NewRequestId()}});
    }
    Close();
    Forget();
  }

  void OnRequest() {
    http::request<http::string_body> request = parser_->release();
    parser_.reset();
    keep_alive_ = request.keep_alive();
    http11_ = request.version() >= 11;
    HttpRequest view;
    view.method = std::string(request.method_string());
    const std::string_view target(request.target().data(), request.target().size());
    view.path = std::string(target.substr(0, target.find('?')));
    view.body = std::move(request.body());
    // Its buffers (and what the handler parses from it) are freed after the reply: counted, so
    // that the serving loop gives large ones back to the OS when idle.
    HeapTrimmer::Process().NoteReleased(view.body.size());
    for (const auto& field : request) {
      std::string name(field.name_string());
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      view.headers[name] = std::string(field.value());
    }
    head_only_ = request.method() == http::verb::head;
    HttpReply reply;
    try {
      reply = state_->handler(view);
    } catch (const std::exception& e) {  // a handler bug: one 500, the server goes on
      RUBATO_LOG_ERROR(kLogSubsystem, "handler for {} {} threw: {}", view.method, view.path,
                       e.what());
      reply = HttpReply{500, "application/json",
                        JsonError(500, std::string("internal error: ") + e.what(),
                                  "internal_error"),
                        nullptr};
    }
    if (reply.pending == nullptr) {
      return WriteWhole(reply.status, reply.content_type, std::move(reply.body), keep_alive_,
                        reply.headers);
    }
    pending_ = std::move(reply.pending);
    ++state_->pending_replies;
    stream_.expires_never();  // the engine's time; the write timeout guards the writes
    WatchPeer();
    std::weak_ptr<Session> weak = shared_from_this();
    pending_->SetNotify([weak, weak_state = state_->self] {
      const std::shared_ptr<HttpServer::State> state = weak_state.lock();
      if (state == nullptr) return;  // the server is gone
      net::post(state->io, [weak] {
        if (auto self = weak.lock()) self->Pump();
      });
    });
  }

  // While a reply is pending nothing else reads the socket. What arrives is kept in buffer_ for
  // after the reply (a pipelined next request; reading it lets the peer's EOF show), up to
  // kReadAheadBytes; an error means the peer is gone; its EOF is handled by OnPeerEof.
  void WatchPeer() {
    stream_.socket().async_wait(
        tcp::socket::wait_read,
        [self = shared_from_this(), watch = watch_](beast::error_code error) {
          if (watch != self->watch_ || self->pending_ == nullptr) return;  // that reply ended
          if (error) return self->CancelPending();
          const auto space = self->buffer_.prepare(4096);
          const ssize_t got = ::recv(self->stream_.socket().native_handle(), space.data(),
                                     space.size(), MSG_DONTWAIT);
          if (got > 0) {
            self->buffer_.commit(static_cast<size_t>(got));
            // Past the limit the rest waits in the socket: a peer that leaves now is noticed
            // by the reply's write only.
            if (self->buffer_.size() < kReadAheadBytes) self->WatchPeer();
          } else if (got == 0) {
            self->OnPeerEof();
          } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            self->WatchPeer();
          } else {
            self->CancelPending();
          }
        });
  }

  // The peer sent its EOF while its reply is pending: it either closed its socket (it is gone)
  // or only shut down its sending side, which HTTP/1.1 allows after a complete request (it still
  // reads the reply). Bytes sent to a closed socket make the peer's TCP answer with a reset, so
  // the connection probes: an HTTP/1.1 client must accept an interim 100 Continue before the
  // reply (RFC 9110 15.2), a stream's next chunk probes as well. A reset cancels the reply.
  // HTTP/1.0 has no interim responses: its EOF is taken as the client gone.
  void OnPeerEof() {
    if (!http11_) return CancelPending();
    probe_ = !header_sent_;
    stream_.socket().async_wait(
        tcp::socket::wait_error,
        [self = shared_from_this(), watch = watch_](beast::error_code error) {
          if (watch != self->watch_ || self->pending_ == nullptr) return;
          if (error || PeerReset(self->stream_.socket().native_handle())) self->CancelPending();
        });
    Pump();
  }

  void Pump() {
    if (pending_ == nullptr || writing_) return;
    PendingReply::Progress progress = pending_->Take();
    std::string out;
    bool done = false;
    if (progress.complete) {
      keep_alive_ = keep_alive_ && !state_->stopping;
      out = ResponseHead(progress.status, progress.content_type, progress.body.size(), false,
                         progress.headers) +
            (head_only_ ? std::string() : progress.body);
      done = true;
    } else if (progress.stream_started) {
      if (!header_sent_) {
        out = ResponseHead(200, progress.content_type, 0, /*chunked=*/true, progress.headers);
        header_sent_ = true;
      }
      if (!progress.body.empty()) out += ChunkOf(progress.body);
      if (progress.stream_ended) {
        out += "0\r\n\r\n";
        done = true;
        if (progress.close_connection || state_->stopping) keep_alive_ = false;
      }
    }
    if (out.empty() && probe_ && !header_sent_) out = kProbe;
    probe_ = false;
    if (out.empty()) return;
    writing_ = true;
    auto data = std::make_shared<std::string>(std::move(out));
    stream_.expires_after(state_->options.write_timeout);
    net::async_write(stream_, net::buffer(*data),
                     [self = shared_from_this(), data, done](beast::error_code error, size_t) {
                       self->writing_ = false;
                       if (error) {
                         self->CancelPending();
                         return;
                       }
                       if (!done) {
                         self->stream_.expires_never();
                         return self->Pump();
                       }
                       self->EndPending();
                       self->AfterReply();
                     });
  }

  void CancelPending() {
    if (pending_ == nullptr) return;
    std::shared_ptr<PendingReply> pending = std::move(pending_);
    pending_.reset();
    --state_->pending_replies;
    pending->Cancel();
    Close();
    Forget();
  }

  void EndPending() {
    if (pending_ == nullptr) return;
    pending_.reset();
    header_sent_ = false;
    probe_ = false;
    --state_->pending_replies;
    ++watch_;  // the watches of this reply see that it ended
    beast::error_code ignored;
    stream_.socket().cancel(ignored);
  }

  std::string ResponseHead(int status, const std::string& content_type, size_t length,
                           bool chunked, const HttpHeaders& headers = {}) const {
    std::string head = "HTTP/1.1 " + StatusLine(status) + "\r\nServer: rubato\r\nContent-Type: " +
                       content_type + "\r\n";
    for (const auto& [name, value] : headers) head += name + ": " + value + "\r\n";
    if (chunked) {
      head += "Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n";
    } else {
      head += "Content-Length: " + std::to_string(length) + "\r\n";
    }
    head += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    return head;
  }

  void WriteWhole(int status, const std::string& content_type, std::string body,
                  bool keep_alive, const HttpHeaders& headers = {}) {
    keep_alive_ = keep_alive && !state_->stopping;
    auto data = std::make_shared<std::string>(
        ResponseHead(status, content_type, body.size(), false, headers) +
        (head_only_ ? std::string() : body));
    stream_.expires_after(state_->options.write_timeout);
    net::async_write(stream_, net::buffer(*data),
                     [self = shared_from_this(), data](beast::error_code error, size_t) {
                       if (error) {
                         self->Close();
                         return self->Forget();
                       }
                       self->AfterReply();
                     });
  }

  void AfterReply() {
    if (keep_alive_ && !state_->stopping) return ReadHeader();
    Close();
    Forget();
  }

  // Drops the server's reference; the session ends when no handler holds it either.
  void Forget() { state_->sessions.erase(shared_from_this()); }

  beast::tcp_stream stream_;
  HttpServer::State* state_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::shared_ptr<PendingReply> pending_;
  bool keep_alive_ = true;
  bool head_only_ = false;  // the current request is HEAD: the reply's head, no body
  bool writing_ = false;
  bool header_sent_ = false;
  bool http11_ = true;                // the current request is HTTP/1.1 (or later)
  bool waiting_for_request_ = false;  // reading the next request, no byte of it seen yet
  bool probe_ = false;                // write the half-close probe (kProbe) when idle
  uint64_t watch_ = 0;                // which pending reply the socket watches belong to
};

// ---- HttpServer -----------------------------------------------------------------------------

namespace {

void Accept(HttpServer::State* state) {
  state->acceptor.async_accept([state](beast::error_code error, tcp::socket socket) {
    if (state->stopping) return;
    if (!error) {
      state->accept_retry.OnSuccess();
      auto session = std::make_shared<Session>(std::move(socket), state);
      state->sessions.insert(session);
      session->Run();
    } else if (error == net::error::operation_aborted) {
      return;
    } else {
      const AcceptRetry::Failure failure =
          state->accept_retry.OnFailure(std::chrono::steady_clock::now());
      if (failure.log_count > 0) {
        RUBATO_LOG_WARN(kLogSubsystem, "accept failed {} time(s): {}; retrying in {} ms",
                        failure.log_count, error.message(), failure.delay.count());
      }
      // Connections already open are served meanwhile; freed descriptors let the next accept in.
      state->accept_backoff.expires_after(failure.delay);
      state->accept_backoff.async_wait([state](beast::error_code wait_error) {
        if (!wait_error && !state->stopping) Accept(state);
      });
      return;
    }
    Accept(state);
  });
}

}  // namespace

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                      HttpHandler handler) {
  std::unique_ptr<HttpServer> server(new HttpServer());
  server->state_ = std::make_shared<State>();
  State& state = *server->state_;
  state.self = server->state_;
  state.options = options;
  state.handler = std::move(handler);
  const std::string where = options.host + ":" + std::to_string(options.port);
  beast::error_code error;
  tcp::resolver resolver(state.io);
  const auto endpoints = resolver.resolve(options.host, std::to_string(options.port),
                                          tcp::resolver::passive, error);
  if (error || endpoints.empty()) {
    return InvalidArgumentError("server.host '" + options.host +
                                "' does not resolve: " + error.message());
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  state.acceptor.open(endpoint.protocol(), error);
  if (!error) state.acceptor.set_option(net::socket_base::reuse_address(true), error);
  if (!error) state.acceptor.bind(endpoint, error);
  if (!error) state.acceptor.listen(net::socket_base::max_listen_connections, error);
  if (error) return UnavailableError("cannot listen on " + where + ": " + error.message());
  server->port_ = state.acceptor.local_endpoint(error).port();
  Accept(&state);
  server->io_thread_ = std::thread([state = server->state_] {
    try {
      state->io.run();
    } catch (const std::exception& e) {
      RUBATO_LOG_ERROR(kLogSubsystem, "I/O thread stopped: {}", e.what());
    }
  });
  return server;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::StopAccepting() {
  if (!io_thread_.joinable()) return;
  State* state = state_.get();
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  net::post(state->io, [state, done] {
    if (!state->stopping) {
      state->stopping = true;
      beast::error_code ignored;
      state->acceptor.close(ignored);
      state->accept_backoff.cancel();
      for (const auto& session : std::set<std::shared_ptr<Session>>(state->sessions)) {
        session->CloseIfIdle();
      }
    }
    done->set_value();
  });
  // The I/O thread runs until Stop joins it; should it have died, do not wait for it forever.
  finished.wait_for(std::chrono::seconds(10));
}

int HttpServer::pending_replies() const { return state_->pending_replies.load(); }

void HttpServer::Stop(std::chrono::milliseconds grace) {
  if (!io_thread_.joinable()) return;
  StopAccepting();
  State* state = state_.get();
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (state->pending_replies.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  net::post(state->io, [state] {
    for (const auto& session : std::set<std::shared_ptr<Session>>(state->sessions)) {
      session->Close();
    }
    state->sessions.clear();
  });
  // Let the closes run their handlers, then stop.
  const auto close_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (state->open_sessions.load() > 0 && std::chrono::steady_clock::now() < close_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  state->io.stop();
  io_thread_.join();
}

}  // namespace rubato::server
