// RpcClient (rpc_client.h). A ClientConnection owns one socket and one I/O thread; socket,
// decoder, write queue, heartbeat timer and last_receive_ belong to that thread. Caller
// threads touch only the pending-call table, health and lost reason, under mutex_, and post
// frames to the I/O thread. Asio handlers capture the raw `this`: the connection joins its
// I/O thread in Close() before it can be destroyed, so no handler outlives it.
#include "transport/rpc/rpc_client.h"

#include <fmt/format.h>

#include <array>
#include <boost/asio.hpp>
#include <charconv>
#include <deque>
#include <future>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "transport/rpc/rpc_auth.h"

namespace rubato::rpc {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

constexpr std::string_view kLog = "rpc";

// How often a connect or a call looks at RpcClientOptions::abandon.
constexpr std::chrono::milliseconds kAbandonPoll{20};

}  // namespace

RpcClientOptions RpcClientOptions::FromLimits(const LimitsSection& limits) {
  RpcClientOptions options;
  options.call_timeout_ms = limits.rpc_timeout_ms;
  options.heartbeat_ms = limits.heartbeat_ms;
  options.peer_timeout_ms = 5 * limits.heartbeat_ms;
  Result<std::string> token = AuthTokenFromEnvironment();
  if (token.ok()) options.auth_token = std::move(token).value();
  return options;
}

Result<RpcEndpoint> ParseRpcEndpoint(std::string_view endpoint) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgumentError(fmt::format(
        "RPC endpoint '{}': {} (expected host:port, e.g. 127.0.0.1:7000)", endpoint, why));
  };
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string_view::npos) return bad("no ':port'");
  std::string_view host = endpoint.substr(0, colon);
  const std::string_view port_text = endpoint.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) return bad("empty host");
  unsigned port = 0;
  const auto [end, ec] =
      std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (port_text.empty() || ec != std::errc() || end != port_text.data() + port_text.size() ||
      port < 1 || port > 65535) {
    return bad(fmt::format("port '{}' is not a number in [1, 65535]", port_text));
  }
  return RpcEndpoint{std::string(host), static_cast<uint16_t>(port)};
}

class ClientConnection {
 public:
  ClientConnection(std::string endpoint, const RpcClientOptions& options)
      : endpoint_(std::move(endpoint)),
        options_(options),
        decoder_(options.max_frame_bytes),
        heartbeat_timer_(io_) {}
  ~ClientConnection() { Close(); }

  // Resolves and connects on the caller's thread, then starts the I/O thread.
  Status Open(const RpcEndpoint& where, std::chrono::milliseconds timeout) {
    const std::string what = fmt::format("connecting to the RPC server at {}", endpoint_);
    tcp::resolver resolver(io_);
    bool done = false;
    boost::system::error_code result;
    std::string failed_step;
    resolver.async_resolve(
        where.host, std::to_string(where.port),
        [&](boost::system::error_code ec, const tcp::resolver::results_type& endpoints) {
          if (ec) {
            result = ec;
            failed_step = "resolving the host";
            done = true;
            return;
          }
          asio::async_connect(socket_, endpoints,
                              [&](boost::system::error_code connect_ec, const tcp::endpoint&) {
                                result = connect_ec;
                                failed_step = "connect";
                                done = true;
                              });
        });
    const auto deadline = Clock::now() + timeout;
    while (!done && !Abandoned()) {
      const auto slice_end = options_.abandon == nullptr
                                 ? deadline
                                 : std::min<Clock::time_point>(deadline, Clock::now() + kAbandonPoll);
      if (io_.run_one_until(slice_end) == 0 && (io_.stopped() || Clock::now() >= deadline)) break;
    }
    if (!done) {
      resolver.cancel();
      boost::system::error_code ignored;
      socket_.close(ignored);
      io_.restart();
      io_.run();  // the cancelled operations' handlers
      if (Abandoned()) return UnavailableError(what + ": given up, the client is stopping");
      return DeadlineExceededError(
          fmt::format("{}: no connection within {} ms", what, timeout.count()));
    }
    if (result) {
      return UnavailableError(
          fmt::format("{}: {} failed: {}", what, failed_step, result.message()));
    }
    boost::system::error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);  // small frames, latency matters
    io_.restart();
    last_receive_ = Clock::now();
    ReadMore();
    ArmHeartbeat();
    io_thread_ = std::thread([this] { io_.run(); });
    return Status::Ok();
  }

  // Sends `request` (call_id assigned here) and waits up to `timeout` for its answer.
  Result<Envelope> Call(Envelope request, std::chrono::milliseconds timeout) {
    auto promise = std::make_shared<std::promise<Result<Envelope>>>();
    std::future<Result<Envelope>> answer = promise->get_future();
    uint64_t call_id = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!lost_.ok()) return lost_;
      call_id = next_call_id_++;
      pending_[call_id] = promise;
    }
    request.set_call_id(call_id);
    Result<std::string> frame = EncodeFrame(request, options_.max_frame_bytes);
    if (!frame.ok()) {
      TakePending(call_id);
      return frame.status().WithContext(fmt::format("RPC call to {}", endpoint_));
    }
    asio::post(io_,
               [this, frame = std::move(frame).value()]() mutable { Enqueue(std::move(frame)); });
    const auto deadline = Clock::now() + timeout;
    bool answered = false;
    while (!answered && Clock::now() < deadline && !Abandoned()) {
      const auto slice =
          options_.abandon == nullptr
              ? deadline - Clock::now()
              : std::min<Clock::duration>(deadline - Clock::now(), kAbandonPoll);
      answered = answer.wait_for(slice) == std::future_status::ready;
    }
    if (!answered && TakePending(call_id)) {
      if (Abandoned()) {
        return UnavailableError(fmt::format("RPC {} to {}: given up, the client is stopping",
                                            BodyName(request), endpoint_));
      }
      return DeadlineExceededError(
          fmt::format("RPC {} to {}: no answer within the deadline of {} ms", BodyName(request),
                      endpoint_, timeout.count()));
    }
    // Answered, or answered / failed while the deadline passed: the promise is set.
    return answer.get();
  }

  bool Healthy() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lost_.ok();
  }
  bool Abandoned() const { return options_.abandon != nullptr && options_.abandon->load(); }
  Status LostReason() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lost_;
  }

  // Fails everything pending, closes the socket, joins the I/O thread. Idempotent.
  void Close() {
    std::lock_guard<std::mutex> lock(close_mutex_);
    if (closed_) return;
    closed_ = true;
    if (io_thread_.joinable()) {
      asio::post(io_, [this] {
        MarkLost(ClosedByUs(), /*log_warning=*/false);
        io_.stop();
      });
      io_thread_.join();
    }
    // Without an I/O thread (never opened, or it ended after a loss) nothing else runs.
    MarkLost(ClosedByUs(), /*log_warning=*/false);
  }

 private:
  // Removes the call from the table; nullptr when the I/O thread already completed it.
  std::shared_ptr<std::promise<Result<Envelope>>> TakePending(uint64_t call_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(call_id);
    if (it == pending_.end()) return nullptr;
    auto promise = std::move(it->second);
    pending_.erase(it);
    return promise;
  }

  Status ClosedByUs() const {
    return UnavailableError(fmt::format("the RPC client to {} was closed", endpoint_));
  }

  // First loss wins: records the reason, fails every pending call with it, closes the socket.
  // A loss is a warning; a deliberate Close() is not.
  void MarkLost(Status reason, bool log_warning = true) {
    std::map<uint64_t, std::shared_ptr<std::promise<Result<Envelope>>>> failed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!lost_.ok()) return;
      lost_ = reason;
      failed.swap(pending_);
    }
    if (log_warning) {
      RUBATO_LOG_WARN(kLog, "{}", reason.ToString());
    } else {
      RUBATO_LOG_INFO(kLog, "{}", reason.ToString());
    }
    for (auto& [id, promise] : failed) promise->set_value(reason);
    boost::system::error_code ignored;
    socket_.close(ignored);
    heartbeat_timer_.cancel();
    write_queue_.clear();
  }

  void Enqueue(std::string frame) {
    if (!Healthy()) return;
    write_queue_.push_back(std::move(frame));
    if (write_queue_.size() == 1) WriteNext();
  }

  void WriteNext() {
    asio::async_write(
        socket_, asio::buffer(write_queue_.front()), [this](boost::system::error_code ec, size_t) {
          if (ec) {
            MarkLost(UnavailableError(fmt::format("writing to the RPC server at {} failed: {}",
                                                  endpoint_, ec.message())));
            return;
          }
          if (write_queue_.empty()) return;  // cleared by MarkLost
          write_queue_.pop_front();
          if (!write_queue_.empty()) WriteNext();
        });
  }

  void ReadMore() {
    socket_.async_read_some(asio::buffer(read_buffer_),
                            [this](boost::system::error_code ec, size_t n) { OnRead(ec, n); });
  }

  void OnRead(boost::system::error_code ec, size_t bytes_read) {
    if (ec) {
      MarkLost(UnavailableError(
          ec == asio::error::eof
              ? fmt::format("the RPC server at {} closed the connection", endpoint_)
              : fmt::format("reading from the RPC server at {} failed: {}", endpoint_,
                            ec.message())));
      return;
    }
    last_receive_ = Clock::now();
    std::vector<Envelope> envelopes;
    const Status decoded =
        decoder_.Feed(std::string_view(read_buffer_.data(), bytes_read), &envelopes);
    for (Envelope& envelope : envelopes) Deliver(std::move(envelope));
    if (!decoded.ok()) {
      MarkLost(UnavailableError(
          fmt::format("the RPC server at {} sent a bad frame: {}", endpoint_, decoded.message())));
      return;
    }
    if (Healthy()) ReadMore();
  }

  void Deliver(Envelope envelope) {
    if (envelope.has_heartbeat()) {
      if (!envelope.heartbeat().reply()) {
        Envelope reply;
        reply.mutable_heartbeat()->set_sequence(envelope.heartbeat().sequence());
        reply.mutable_heartbeat()->set_reply(true);
        if (Result<std::string> frame = EncodeFrame(reply); frame.ok()) {
          Enqueue(std::move(frame).value());
        }
      }
      return;
    }
    if (envelope.call_id() == 0 && envelope.has_error()) {
      // An error about the stream itself: the server closes the connection after it.
      MarkLost(UnavailableError(
          fmt::format("the RPC server at {} reported: {}", endpoint_, envelope.error().message())));
      return;
    }
    auto promise = TakePending(envelope.call_id());
    if (envelope.has_error() && envelope.error().closes_connection()) {
      // A refused Hello: the server closes the connection next. Lost now, quietly (the caller
      // reports the error), so that the close is not logged as a peer gone away.
      MarkLost(UnavailableError(fmt::format("the RPC server at {} closed the connection: {}",
                                            endpoint_, envelope.error().message())),
               /*log_warning=*/false);
    }
    if (promise == nullptr) {
      RUBATO_LOG_DEBUG(kLog, "RPC {} from {} for call {} after its deadline, dropped",
                       BodyName(envelope), endpoint_, envelope.call_id());
      return;
    }
    promise->set_value(std::move(envelope));
  }

  void ArmHeartbeat() {
    heartbeat_timer_.expires_after(std::chrono::milliseconds(options_.heartbeat_ms));
    heartbeat_timer_.async_wait([this](boost::system::error_code ec) {
      if (ec || !Healthy()) return;
      const auto silent_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_receive_)
              .count();
      if (silent_ms >= options_.peer_timeout_ms) {
        MarkLost(UnavailableError(fmt::format(
            "the RPC server at {} sent nothing for {} ms (peer timeout {} ms, heartbeat every "
            "{} ms): the server process is stopped, hung or unreachable",
            endpoint_, silent_ms, options_.peer_timeout_ms, options_.heartbeat_ms)));
        return;
      }
      Envelope heartbeat;
      heartbeat.mutable_heartbeat()->set_sequence(++heartbeat_sequence_);
      if (Result<std::string> frame = EncodeFrame(heartbeat); frame.ok()) {
        Enqueue(std::move(frame).value());
      }
      ArmHeartbeat();
    });
  }

  const std::string endpoint_;
  const RpcClientOptions options_;
  asio::io_context io_;
  tcp::socket socket_{io_};
  FrameDecoder decoder_;
  asio::steady_timer heartbeat_timer_;
  std::array<char, 64 * 1024> read_buffer_;  // raw stream bytes of the latest read
  std::deque<std::string> write_queue_;      // whole frames; the front one is being written
  Clock::time_point last_receive_;
  uint64_t heartbeat_sequence_ = 0;
  std::thread io_thread_;

  mutable std::mutex mutex_;  // guards the three below
  uint64_t next_call_id_ = 1;
  std::map<uint64_t, std::shared_ptr<std::promise<Result<Envelope>>>> pending_;
  Status lost_;  // ok while healthy

  std::mutex close_mutex_;
  bool closed_ = false;
};

namespace {

Status CheckOptions(const RpcClientOptions& options) {
  const auto check = [](std::string_view name, int value) {
    return value >= 1 ? Status::Ok()
                      : InvalidArgumentError(fmt::format(
                            "RPC client: {} must be at least 1 ms, got {}", name, value));
  };
  RUBATO_RETURN_IF_ERROR(check("call_timeout_ms", options.call_timeout_ms));
  RUBATO_RETURN_IF_ERROR(check("heartbeat_ms", options.heartbeat_ms));
  RUBATO_RETURN_IF_ERROR(check("peer_timeout_ms", options.peer_timeout_ms));
  if (options.max_frame_bytes < 64) {
    return InvalidArgumentError(fmt::format(
        "RPC client: max_frame_bytes must be at least 64, got {}", options.max_frame_bytes));
  }
  return Status::Ok();
}

Result<std::shared_ptr<ClientConnection>> OpenConnection(const std::string& endpoint,
                                                         std::chrono::milliseconds timeout,
                                                         const RpcClientOptions& options) {
  RUBATO_ASSIGN_OR_RETURN(const RpcEndpoint where, ParseRpcEndpoint(endpoint));
  auto connection = std::make_shared<ClientConnection>(endpoint, options);
  RUBATO_RETURN_IF_ERROR(connection->Open(where, timeout));
  return connection;
}

}  // namespace

RpcClient::RpcClient(std::string endpoint, RpcClientOptions options,
                     std::shared_ptr<ClientConnection> connection)
    : endpoint_(std::move(endpoint)), options_(options), connection_(std::move(connection)) {}

RpcClient::~RpcClient() { Close(); }

Result<std::unique_ptr<RpcClient>> RpcClient::Connect(std::string_view endpoint,
                                                      std::chrono::milliseconds connect_timeout,
                                                      const RpcClientOptions& options) {
  RUBATO_RETURN_IF_ERROR(CheckOptions(options));
  RUBATO_ASSIGN_OR_RETURN(auto connection,
                          OpenConnection(std::string(endpoint), connect_timeout, options));
  return std::unique_ptr<RpcClient>(
      new RpcClient(std::string(endpoint), options, std::move(connection)));
}

std::shared_ptr<ClientConnection> RpcClient::Current() const {
  std::lock_guard<std::mutex> lock(connection_mutex_);
  return connection_;
}

Status RpcClient::Reconnect(std::chrono::milliseconds connect_timeout) {
  RUBATO_ASSIGN_OR_RETURN(auto fresh, OpenConnection(endpoint_, connect_timeout, options_));
  std::shared_ptr<ClientConnection> old;
  {
    std::lock_guard<std::mutex> lock(connection_mutex_);
    old = std::exchange(connection_, std::move(fresh));
  }
  old->Close();
  return Status::Ok();
}

void RpcClient::Close() { Current()->Close(); }

bool RpcClient::Healthy() const { return Current()->Healthy(); }

Status RpcClient::LostReason() const { return Current()->LostReason(); }

Result<Envelope> RpcClient::Call(Envelope request, Envelope::BodyCase expected,
                                 std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) timeout = std::chrono::milliseconds(options_.call_timeout_ms);
  const std::string request_name(BodyName(request));
  RUBATO_ASSIGN_OR_RETURN(Envelope response, Current()->Call(std::move(request), timeout));
  if (response.has_error()) return StatusFromError(response.error());
  if (response.body_case() != expected) {
    return InternalError(fmt::format("the RPC server at {} answered a {} with a {}", endpoint_,
                                     request_name, BodyName(response)));
  }
  return response;
}

Result<HelloResponse> RpcClient::Hello(HelloRequest request, std::chrono::milliseconds timeout) {
  if (request.protocol_version() == 0) request.set_protocol_version(kProtocolVersion);
  if (request.heartbeat_ms() == 0) {
    request.set_heartbeat_ms(static_cast<uint32_t>(options_.heartbeat_ms));
  }
  if (request.auth_token().empty()) request.set_auth_token(options_.auth_token);
  Envelope envelope;
  *envelope.mutable_hello_request() = std::move(request);
  RUBATO_ASSIGN_OR_RETURN(Envelope response,
                          Call(std::move(envelope), Envelope::kHelloResponse, timeout));
  if (response.hello_response().protocol_version() != kProtocolVersion) {
    return FailedPreconditionError(fmt::format(
        "protocol version mismatch: protocol_version is {} here, {} in the Hello response of {}",
        kProtocolVersion, response.hello_response().protocol_version(), endpoint_));
  }
  return std::move(*response.mutable_hello_response());
}

Result<OpenSessionResponse> RpcClient::OpenSession(const OpenSessionRequest& request,
                                                   std::chrono::milliseconds timeout) {
  Envelope envelope;
  *envelope.mutable_open_session_request() = request;
  RUBATO_ASSIGN_OR_RETURN(Envelope response,
                          Call(std::move(envelope), Envelope::kOpenSessionResponse, timeout));
  return std::move(*response.mutable_open_session_response());
}

Result<CloseSessionResponse> RpcClient::CloseSession(const CloseSessionRequest& request,
                                                     std::chrono::milliseconds timeout) {
  Envelope envelope;
  *envelope.mutable_close_session_request() = request;
  RUBATO_ASSIGN_OR_RETURN(Envelope response,
                          Call(std::move(envelope), Envelope::kCloseSessionResponse, timeout));
  return std::move(*response.mutable_close_session_response());
}

Result<StatsResponse> RpcClient::Stats(std::chrono::milliseconds timeout) {
  Envelope envelope;
  envelope.mutable_stats_request();
  RUBATO_ASSIGN_OR_RETURN(Envelope response,
                          Call(std::move(envelope), Envelope::kStatsResponse, timeout));
  return std::move(*response.mutable_stats_response());
}

Result<HealthResponse> RpcClient::Health(std::chrono::milliseconds timeout) {
  Envelope envelope;
  envelope.mutable_health_request();
  RUBATO_ASSIGN_OR_RETURN(Envelope response,
                          Call(std::move(envelope), Envelope::kHealthResponse, timeout));
  return std::move(*response.mutable_health_response());
}

Result<ShutdownResponse> RpcClient::Shutdown(const ShutdownRequest& request,
                                             std::chrono::milliseconds timeout) {
  Envelope envelope;
  *envelope.mutable_shutdown_request() = request;
  RUBATO_ASSIGN_OR_RETURN(Envelope response,
                          Call(std::move(envelope), Envelope::kShutdownResponse, timeout));
  return std::move(*response.mutable_shutdown_response());
}

}  // namespace rubato::rpc
