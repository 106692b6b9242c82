// RpcServer (rpc_server.h): one Boost.Asio I/O thread owns the acceptor, every socket, every
// timer and every write queue; handler calls run on a thread pool and post their responses
// back to the I/O thread. All ServerConnection members are touched on the I/O thread only,
// except hello_done_ (atomic, read and set by handler tasks). The token of a Hello is checked
// on the I/O thread, in the connection's order, so that a refused Hello is the last thing of its
// connection that is read.
#include "transport/rpc/rpc_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <boost/asio.hpp>
#include <chrono>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common/accept_retry.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "transport/rpc/rpc_auth.h"

namespace rubato::rpc {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

constexpr std::string_view kLog = "rpc";

// Fills `out` with the handler's response, or with an Error body carrying its Status.
template <typename Response>
void SetBodyOrError(Result<Response> result, Response* (Envelope::*mutable_body)(), Envelope* out) {
  if (result.ok()) {
    *(out->*mutable_body)() = std::move(result).value();
  } else {
    *out->mutable_error() = ErrorFromStatus(result.status());
  }
}

// The first field where `peer` differs from `ours`, as "<field> is <ours> here, <peer> in the
// peer's Hello"; empty when they agree.
std::string ModelShapeMismatch(const ModelShape& ours, const ModelShape& peer) {
  const auto differs = [](std::string_view field, auto here, auto there) {
    return here == there ? std::string()
                         : fmt::format("{} is {} here, {} in the peer's Hello", field, here, there);
  };
  for (std::string mismatch :
       {differs("num_layers", ours.num_layers(), peer.num_layers()),
        differs("num_kv_heads", ours.num_kv_heads(), peer.num_kv_heads()),
        differs("num_query_heads", ours.num_query_heads(), peer.num_query_heads()),
        differs("head_dim", ours.head_dim(), peer.head_dim()),
        differs("kv_dtype", fmt::format("'{}'", ours.kv_dtype()),
                fmt::format("'{}'", peer.kv_dtype()))}) {
    if (!mismatch.empty()) return mismatch;
  }
  return {};
}

// The longest heartbeat interval a client may ask for: it is silent for at most 5 of them.
constexpr uint32_t kMaxPeerHeartbeatMs = 60000;

// The answer to a Hello whose token is missing or wrong; names the variables, never a token.
Status AuthenticationFailed(const HelloRequest& hello) {
  return FailedPreconditionError(fmt::format(
      "authentication failed: this server requires a token ({} or {} on both sides) and the "
      "peer's Hello carries {}",
      kTokenEnv, kTokenFileEnv, hello.auth_token().empty() ? "none" : "another"));
}

}  // namespace

class ServerConnection;

class RpcServerImpl {
 public:
  RpcServerImpl(const RpcServerOptions& options, RpcHandler* handler)
      : options_(options),
        handler_(handler),
        work_guard_(asio::make_work_guard(io_)),
        handler_pool_(static_cast<size_t>(options.handler_threads)) {}
  ~RpcServerImpl() { Stop(); }

  Result<uint16_t> Listen();
  void StartThreads() {
    AcceptNext();
    io_thread_ = std::thread([this] { io_.run(); });
  }
  void Stop();

  // The response (or Error) to one request; runs on a handler thread.
  Envelope Answer(ConnectionId id, std::atomic<bool>* hello_done, const Envelope& request);

  void Forget(ConnectionId id) {
    std::lock_guard<std::mutex> lock(connections_mutex_);
    connections_.erase(id);
  }
  size_t NumConnections() const {
    std::lock_guard<std::mutex> lock(connections_mutex_);
    return connections_.size();
  }

  const RpcServerOptions options_;
  RpcHandler* const handler_;
  std::atomic<bool> stopping_{false};
  // Declared before everything holding sockets or timers: destroyed after them.
  asio::io_context io_;

 private:
  Result<HelloResponse> AnswerHello(ConnectionId id, const HelloRequest& hello);
  void AcceptNext();

  asio::executor_work_guard<asio::io_context::executor_type> work_guard_;
  tcp::acceptor acceptor_{io_};
  // Failed accepts (descriptors exhausted) back off instead of spinning (common/accept_retry.h).
  asio::steady_timer accept_backoff_{io_};
  AcceptRetry accept_retry_;
  asio::thread_pool handler_pool_;
  std::thread io_thread_;
  std::mutex stop_mutex_;
  bool stopped_ = false;
  ConnectionId next_connection_id_ = 1;  // I/O thread only
  mutable std::mutex connections_mutex_;
  std::map<ConnectionId, std::shared_ptr<ServerConnection>> connections_;

  friend class ServerConnection;
};

// One accepted socket: reads and decodes frames, answers heartbeats, sends requests to the
// handler pool, writes responses in order of completion, and watches for silence.
class ServerConnection : public std::enable_shared_from_this<ServerConnection> {
 public:
  ServerConnection(RpcServerImpl* server, ConnectionId id, tcp::socket socket)
      : server_(server),
        id_(id),
        socket_(std::move(socket)),
        decoder_(server->options_.max_frame_bytes),
        idle_timer_(server->io_),
        refusal_timer_(server->io_) {
    boost::system::error_code ec;
    const tcp::endpoint remote = socket_.remote_endpoint(ec);
    peer_ = ec ? std::string("unknown peer")
               : fmt::format("{}:{}", remote.address().to_string(), remote.port());
  }

  ConnectionId id() const { return id_; }

  void Start() {
    last_receive_ = Clock::now();
    ArmIdleTimer();
    ReadMore();
  }

  // Queues one frame (I/O thread). Dropped when the connection is already closed.
  void Send(const Envelope& envelope) {
    if (closed_) return;
    Result<std::string> frame = EncodeFrame(envelope, server_->options_.max_frame_bytes);
    if (!frame.ok()) {
      // A response too large to send: tell the caller instead of leaving it waiting.
      Envelope error;
      error.set_call_id(envelope.call_id());
      *error.mutable_error() = ErrorFromStatus(frame.status());
      frame = EncodeFrame(error, server_->options_.max_frame_bytes);
      if (!frame.ok()) return;
    }
    write_queue_.push_back(std::move(frame).value());
    if (write_queue_.size() == 1) WriteNext();
  }

  // Closes the socket (I/O thread); tells the handler unless the server is stopping.
  void Close(const Status& reason) {
    if (closed_) return;
    closed_ = true;
    boost::system::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    idle_timer_.cancel();
    refusal_timer_.cancel();
    server_->Forget(id_);
    if (server_->stopping_) return;
    RUBATO_LOG_INFO(kLog, "RPC connection {} ({}) closed: {}", id_, peer_, reason.ToString());
    // On the pool: the handler may take locks or time, never on the I/O thread.
    asio::post(server_->handler_pool_, [server = server_, id = id_, reason] {
      try {
        server->handler_->OnConnectionLost(id, reason);
      } catch (const std::exception& e) {
        RUBATO_LOG_ERROR(kLog, "RpcHandler::OnConnectionLost({}) threw: {}", id, e.what());
      }
    });
  }

 private:
  void ReadMore() {
    socket_.async_read_some(asio::buffer(read_buffer_),
                            [self = shared_from_this()](boost::system::error_code ec, size_t n) {
                              self->OnRead(ec, n);
                            });
  }

  void OnRead(boost::system::error_code ec, size_t bytes_read) {
    if (closed_) return;
    if (ec) {
      Close(ec == asio::error::eof
                ? UnavailableError(
                      fmt::format("connection {} from {} closed by the peer", id_, peer_))
                : UnavailableError(fmt::format("reading from connection {} ({}) failed: {}", id_,
                                               peer_, ec.message())));
      return;
    }
    last_receive_ = Clock::now();
    std::vector<Envelope> envelopes;
    const Status decoded =
        decoder_.Feed(std::string_view(read_buffer_.data(), bytes_read), &envelopes);
    for (Envelope& envelope : envelopes) Handle(std::move(envelope));
    if (refused_) return;  // the refusal timer answers and closes; nothing more is read
    if (!decoded.ok()) {
      FailProtocol(decoded.WithContext(fmt::format("connection {} from {}", id_, peer_)));
      return;
    }
    ReadMore();
  }

  void Handle(Envelope envelope) {
    if (refused_) return;  // frames that came in the same read after a refused Hello
    if (envelope.has_hello_request() && !server_->options_.auth_token.empty() &&
        !TokensEqual(envelope.hello_request().auth_token(), server_->options_.auth_token)) {
      RefuseAuthentication(envelope);
      return;
    }
    if (envelope.body_case() == Envelope::kHeartbeat) {
      if (!envelope.heartbeat().reply()) {
        Envelope reply;
        reply.mutable_heartbeat()->set_sequence(envelope.heartbeat().sequence());
        reply.mutable_heartbeat()->set_reply(true);
        Send(reply);
      }
      return;
    }
    if (envelope.body_case() == Envelope::kError) {
      RUBATO_LOG_WARN(kLog, "connection {} ({}) sent an error: {}", id_, peer_,
                      envelope.error().message());
      return;
    }
    if (envelope.has_hello_request() && envelope.hello_request().heartbeat_ms() > 0) {
      // Wait 5 of the client's heartbeats, never less than the server's own peer timeout.
      const int64_t five_beats = 5 * static_cast<int64_t>(envelope.hello_request().heartbeat_ms());
      peer_timeout_ms_ = static_cast<int>(std::min<int64_t>(
          std::max<int64_t>(server_->options_.peer_timeout_ms, five_beats), INT32_MAX));
    }
    asio::post(server_->handler_pool_,
               [self = shared_from_this(), request = std::move(envelope)]() mutable {
                 Envelope response = self->server_->Answer(self->id_, &self->hello_done_, request);
                 asio::post(self->server_->io_,
                            [self, response = std::move(response)] { self->Send(response); });
               });
  }

  // A Hello without the server's token: logged, counted, answered after the delay, then the
  // connection closes. Until then nothing is read, the idle timer is off and the handler pool
  // is not involved.
  void RefuseAuthentication(const Envelope& hello) {
    refused_ = true;
    idle_timer_.cancel();
    const RpcServerOptions& options = server_->options_;
    RUBATO_LOG_WARN(kLog,
                    "RPC connection {} from {}: authentication failed (its Hello carries {} "
                    "token); answering and closing the connection in {} ms",
                    id_, peer_, hello.hello_request().auth_token().empty() ? "no" : "another",
                    options.auth_failure_delay_ms);
    if (options.auth_failures != nullptr) options.auth_failures->Increment();
    Envelope answer;
    answer.set_call_id(hello.call_id());
    *answer.mutable_error() = ErrorFromStatus(AuthenticationFailed(hello.hello_request()));
    answer.mutable_error()->set_closes_connection(true);
    refusal_timer_.expires_after(std::chrono::milliseconds(options.auth_failure_delay_ms));
    refusal_timer_.async_wait([self = shared_from_this(), answer = std::move(answer)](
                                  boost::system::error_code ec) {
      if (ec || self->closed_) return;
      self->close_reason_ = UnavailableError(fmt::format(
          "connection {} from {}: authentication failed", self->id_, self->peer_));
      self->close_after_write_ = true;
      self->Send(answer);
    });
  }

  // Tells the peer what was wrong with its bytes, then closes once that frame is written.
  void FailProtocol(const Status& error) {
    RUBATO_LOG_WARN(kLog, "{}", error.ToString());
    Envelope envelope;
    *envelope.mutable_error() = ErrorFromStatus(error);
    close_reason_ = error;
    close_after_write_ = true;
    Send(envelope);
  }

  void WriteNext() {
    asio::async_write(
        socket_, asio::buffer(write_queue_.front()),
        [self = shared_from_this()](boost::system::error_code ec, size_t) { self->OnWritten(ec); });
  }

  void OnWritten(boost::system::error_code ec) {
    if (closed_) return;
    if (ec) {
      Close(UnavailableError(
          fmt::format("writing to connection {} ({}) failed: {}", id_, peer_, ec.message())));
      return;
    }
    write_queue_.pop_front();
    if (!write_queue_.empty()) {
      WriteNext();
    } else if (close_after_write_) {
      Close(close_reason_);
    }
  }

  void ArmIdleTimer() {
    idle_timer_.expires_at(last_receive_ + std::chrono::milliseconds(peer_timeout_ms_));
    idle_timer_.async_wait(
        [self = shared_from_this()](boost::system::error_code ec) { self->OnIdleTimer(ec); });
  }

  void OnIdleTimer(boost::system::error_code ec) {
    if (ec || closed_ || refused_) return;
    const auto timeout = std::chrono::milliseconds(peer_timeout_ms_);
    if (Clock::now() - last_receive_ >= timeout) {
      Close(UnavailableError(fmt::format(
          "connection {} from {} sent nothing (not even a heartbeat) for {} ms, the peer timeout",
          id_, peer_, peer_timeout_ms_)));
      return;
    }
    ArmIdleTimer();
  }

  RpcServerImpl* const server_;
  const ConnectionId id_;
  tcp::socket socket_;
  std::string peer_;                         // "ip:port" of the remote end, for messages
  std::array<char, 64 * 1024> read_buffer_;  // raw stream bytes of the latest read
  FrameDecoder decoder_;
  std::deque<std::string> write_queue_;  // whole frames; the front one is being written
  asio::steady_timer idle_timer_;
  asio::steady_timer refusal_timer_;  // RefuseAuthentication's delay
  Clock::time_point last_receive_;
  bool closed_ = false;
  bool refused_ = false;  // a Hello without the token came: read nothing more
  bool close_after_write_ = false;
  Status close_reason_;
  std::atomic<bool> hello_done_{false};
  // The server's peer_timeout_ms, raised to 5 of the client's heartbeats by its Hello. I/O
  // thread only.
  int peer_timeout_ms_ = server_->options_.peer_timeout_ms;
};

Result<uint16_t> RpcServerImpl::Listen() {
  boost::system::error_code ec;
  const asio::ip::address address = asio::ip::make_address(options_.host, ec);
  if (ec) {
    return InvalidArgumentError(
        fmt::format("RPC server: host '{}' is not an IP address (use e.g. 127.0.0.1 or 0.0.0.0)",
                    options_.host));
  }
  const tcp::endpoint endpoint(address, options_.port);
  const std::string where = fmt::format("RPC server on {}:{}", options_.host, options_.port);
  if (acceptor_.open(endpoint.protocol(), ec)) {
    return UnavailableError(fmt::format("{}: opening a socket failed: {}", where, ec.message()));
  }
  // SO_REUSEADDR: a restarted server gets its port back while old connections are in TIME_WAIT.
  acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (acceptor_.bind(endpoint, ec)) {
    return UnavailableError(fmt::format("{}: bind failed: {}", where, ec.message()));
  }
  if (acceptor_.listen(asio::socket_base::max_listen_connections, ec)) {
    return UnavailableError(fmt::format("{}: listen failed: {}", where, ec.message()));
  }
  const tcp::endpoint bound = acceptor_.local_endpoint(ec);
  if (ec) return UnavailableError(fmt::format("{}: no local endpoint: {}", where, ec.message()));
  return bound.port();
}

void RpcServerImpl::AcceptNext() {
  acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (stopping_ || !acceptor_.is_open()) return;
    if (ec) {
      const AcceptRetry::Failure failure =
          accept_retry_.OnFailure(std::chrono::steady_clock::now());
      if (failure.log_count > 0) {
        RUBATO_LOG_WARN(kLog, "RPC server: accept failed {} time(s): {}; retrying in {} ms",
                        failure.log_count, ec.message(), failure.delay.count());
      }
      // Connections already open are served meanwhile; freed descriptors let the next accept in.
      accept_backoff_.expires_after(failure.delay);
      accept_backoff_.async_wait([this](boost::system::error_code wait_error) {
        if (!wait_error && !stopping_) AcceptNext();
      });
      return;
    } else {
      accept_retry_.OnSuccess();
      auto connection =
          std::make_shared<ServerConnection>(this, next_connection_id_++, std::move(socket));
      {
        std::lock_guard<std::mutex> lock(connections_mutex_);
        connections_[connection->id()] = connection;
      }
      connection->Start();
    }
    AcceptNext();
  });
}

Result<HelloResponse> RpcServerImpl::AnswerHello(ConnectionId id, const HelloRequest& hello) {
  if (hello.protocol_version() != kProtocolVersion) {
    return FailedPreconditionError(fmt::format(
        "protocol version mismatch: protocol_version is {} here, {} in the peer's Hello",
        kProtocolVersion, hello.protocol_version()));
  }
  // Checked again (the I/O thread refused wrong tokens before the Hello reached the pool).
  if (!options_.auth_token.empty() && !TokensEqual(hello.auth_token(), options_.auth_token)) {
    return AuthenticationFailed(hello);
  }
  if (hello.heartbeat_ms() > kMaxPeerHeartbeatMs) {
    return FailedPreconditionError(
        fmt::format("heartbeat_ms {} in the peer's Hello is over the {} this server allows",
                    hello.heartbeat_ms(), kMaxPeerHeartbeatMs));
  }
  if (hello.role() != options_.served_peer_role) {
    return FailedPreconditionError(
        fmt::format("role mismatch: this server serves {} peers, the peer's Hello says role {}",
                    Role_Name(options_.served_peer_role), Role_Name(hello.role())));
  }
  if (options_.model_shape.has_value()) {
    const std::string mismatch = ModelShapeMismatch(*options_.model_shape, hello.model_shape());
    if (!mismatch.empty()) return FailedPreconditionError("model shape mismatch: " + mismatch);
  }
  RUBATO_ASSIGN_OR_RETURN(HelloResponse response, handler_->OnHello(id, hello));
  response.set_protocol_version(kProtocolVersion);
  if (response.role() == ROLE_UNSPECIFIED) response.set_role(options_.own_role);
  if (!response.has_model_shape() && options_.model_shape.has_value()) {
    *response.mutable_model_shape() = *options_.model_shape;
  }
  return response;
}

Envelope RpcServerImpl::Answer(ConnectionId id, std::atomic<bool>* hello_done,
                               const Envelope& request) {
  Envelope response;
  response.set_call_id(request.call_id());
  const bool is_request = request.has_hello_request() || request.has_open_session_request() ||
                          request.has_close_session_request() || request.has_stats_request() ||
                          request.has_health_request() || request.has_shutdown_request();
  if (!is_request) {
    *response.mutable_error() = ErrorFromStatus(InvalidArgumentError(
        fmt::format("RPC server: a '{}' body is not a request", BodyName(request))));
    return response;
  }
  if (!request.has_hello_request() && !hello_done->load()) {
    *response.mutable_error() = ErrorFromStatus(FailedPreconditionError(fmt::format(
        "RPC server: '{}' before a successful Hello on this connection; call Hello first",
        BodyName(request))));
    return response;
  }
  try {
    switch (request.body_case()) {
      case Envelope::kHelloRequest: {
        Result<HelloResponse> hello = AnswerHello(id, request.hello_request());
        if (hello.ok()) hello_done->store(true);
        SetBodyOrError(std::move(hello), &Envelope::mutable_hello_response, &response);
        break;
      }
      case Envelope::kOpenSessionRequest:
        SetBodyOrError(handler_->OnOpenSession(id, request.open_session_request()),
                       &Envelope::mutable_open_session_response, &response);
        break;
      case Envelope::kCloseSessionRequest:
        SetBodyOrError(handler_->OnCloseSession(id, request.close_session_request()),
                       &Envelope::mutable_close_session_response, &response);
        break;
      case Envelope::kStatsRequest:
        SetBodyOrError(handler_->OnStats(id, request.stats_request()),
                       &Envelope::mutable_stats_response, &response);
        break;
      case Envelope::kHealthRequest:
        SetBodyOrError(handler_->OnHealth(id, request.health_request()),
                       &Envelope::mutable_health_response, &response);
        break;
      case Envelope::kShutdownRequest:
        SetBodyOrError(handler_->OnShutdown(id, request.shutdown_request()),
                       &Envelope::mutable_shutdown_response, &response);
        break;
      default:
        break;  // excluded by is_request above
    }
  } catch (const std::exception& e) {
    // Exceptions never cross the RPC: the caller gets an error, the server keeps serving.
    response.clear_body();
    *response.mutable_error() = ErrorFromStatus(InternalError(
        fmt::format("RPC server: the handler of '{}' threw: {}", BodyName(request), e.what())));
  }
  return response;
}

void RpcServerImpl::Stop() {
  std::lock_guard<std::mutex> lock(stop_mutex_);
  if (stopped_) return;
  stopped_ = true;
  stopping_ = true;
  asio::post(io_, [this] {
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    accept_backoff_.cancel();
    std::vector<std::shared_ptr<ServerConnection>> open;
    {
      std::lock_guard<std::mutex> connections_lock(connections_mutex_);
      for (auto& [id, connection] : connections_) open.push_back(connection);
    }
    for (auto& connection : open) connection->Close(UnavailableError("RPC server stopping"));
  });
  // With every socket, timer and the acceptor closed, run() returns once their handlers ran.
  work_guard_.reset();
  if (io_thread_.joinable()) io_thread_.join();
  handler_pool_.join();  // lets running handler calls finish
  // Responses those calls posted afterwards go to closed connections: run them to release them.
  io_.restart();
  io_.poll();
  std::lock_guard<std::mutex> connections_lock(connections_mutex_);
  connections_.clear();
}

RpcServer::RpcServer(std::unique_ptr<RpcServerImpl> impl, uint16_t bound_port)
    : impl_(std::move(impl)), bound_port_(bound_port) {}

RpcServer::~RpcServer() { Stop(); }

Result<std::unique_ptr<RpcServer>> RpcServer::Start(const RpcServerOptions& options,
                                                    RpcHandler* handler) {
  if (handler == nullptr) return InvalidArgumentError("RPC server: handler is null");
  if (options.peer_timeout_ms < 1) {
    return InvalidArgumentError(fmt::format(
        "RPC server: peer_timeout_ms must be at least 1, got {}", options.peer_timeout_ms));
  }
  if (options.handler_threads < 1 || options.handler_threads > 256) {
    return InvalidArgumentError(fmt::format(
        "RPC server: handler_threads must be in [1, 256], got {}", options.handler_threads));
  }
  if (options.max_frame_bytes < 64) {
    return InvalidArgumentError(fmt::format(
        "RPC server: max_frame_bytes must be at least 64, got {}", options.max_frame_bytes));
  }
  if (options.auth_failure_delay_ms < 0 || options.auth_failure_delay_ms > 60000) {
    return InvalidArgumentError(
        fmt::format("RPC server: auth_failure_delay_ms must be in [0, 60000], got {}",
                    options.auth_failure_delay_ms));
  }
  auto impl = std::make_unique<RpcServerImpl>(options, handler);
  RUBATO_ASSIGN_OR_RETURN(const uint16_t port, impl->Listen());
  impl->StartThreads();
  RUBATO_LOG_INFO(kLog, "RPC server listening on {}:{}", options.host, port);
  return std::unique_ptr<RpcServer>(new RpcServer(std::move(impl), port));
}

void RpcServer::Stop() { impl_->Stop(); }

std::string RpcServer::endpoint() const {
  return fmt::format("{}:{}", impl_->options_.host, bound_port_);
}

size_t RpcServer::num_connections() const { return impl_->NumConnections(); }

}  // namespace rubato::rpc
