// The test fixture of the RPC control-plane tests (rpc_test.cc, rpc_liveness_test.cc): a
// server on 127.0.0.1 with an OS-chosen port and a TestHandler that answers every request with
// values derived from the request and records what it saw; clients with fast heartbeats; raw
// TCP sockets whose reads are bounded. Every wait is bounded by kBound and is never a timing
// threshold.
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "transport/rpc/rpc_client.h"
#include "transport/rpc/rpc_frame.h"
#include "transport/rpc/rpc_server.h"

namespace rubato::rpc::test_support {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// Upper bound of every wait in these tests; never a timing threshold.
inline constexpr milliseconds kBound{5000};

inline bool WaitFor(const std::function<bool()>& condition, milliseconds bound = kBound) {
  const auto deadline = Clock::now() + bound;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return condition();
}

inline bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

inline ModelShape TestShape() {
  ModelShape shape;
  shape.set_num_layers(36);
  shape.set_num_kv_heads(8);
  shape.set_num_query_heads(32);
  shape.set_head_dim(128);
  shape.set_kv_dtype("bf16");
  return shape;
}

inline HelloRequest GoodHello() {
  HelloRequest hello;
  hello.set_role(ROLE_INFERENCE);
  hello.set_rank(2);
  *hello.mutable_model_shape() = TestShape();
  hello.set_transport_backend("ucx");
  hello.set_transport_address(std::string("\x01\x00\xfe worker", 10));
  return hello;
}

// Answers every request with values derived from the request, records what it saw, stalls
// Health while `stall_health` is set (until released), and fails OpenSession for capacity 0.
class TestHandler : public RpcHandler {
 public:
  Result<HelloResponse> OnHello(ConnectionId connection, const HelloRequest& request) override {
    std::lock_guard<std::mutex> lock(mutex_);
    hellos_.push_back(request);
    HelloResponse response;
    response.set_rank(7);
    response.set_transport_backend(request.transport_backend());
    response.set_transport_address("cache-address");
    return response;
  }
  Result<OpenSessionResponse> OnOpenSession(ConnectionId connection,
                                            const OpenSessionRequest& request) override {
    if (request.capacity_tokens() == 0) {
      return ResourceExhaustedError("open session: capacity_tokens is 0, need at least 1");
    }
    OpenSessionResponse response;
    response.set_session_id(request.request_id() + 1000);
    response.set_bytes_reserved(2ull * request.num_layers() * request.num_kv_heads() *
                                request.head_dim() * request.capacity_tokens() *
                                (request.dtype() == "f32" ? 4 : 2));
    return response;
  }
  Result<CloseSessionResponse> OnCloseSession(ConnectionId connection,
                                              const CloseSessionRequest& request) override {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_sessions_.push_back(request.session_id());
    return CloseSessionResponse();
  }
  Result<StatsResponse> OnStats(ConnectionId connection, const StatsRequest&) override {
    StatsResponse response;
    response.set_sessions_open(3);
    response.set_bytes_in_use(4096);
    response.set_bytes_capacity(1 << 20);
    (*response.mutable_counters())["appends_total"] = 12.5;
    (*response.mutable_counters())["connection"] = static_cast<double>(connection);
    return response;
  }
  Result<HealthResponse> OnHealth(ConnectionId connection, const HealthRequest&) override {
    std::unique_lock<std::mutex> lock(mutex_);
    released_.wait_for(lock, kBound, [&] { return !stall_health_; });
    HealthResponse response;
    response.set_status("ok");
    response.set_uptime_s(1.5);
    return response;
  }
  Result<ShutdownResponse> OnShutdown(ConnectionId connection,
                                      const ShutdownRequest& request) override {
    std::lock_guard<std::mutex> lock(mutex_);
    shutdown_reasons_.push_back(request.reason());
    return ShutdownResponse();
  }
  void OnConnectionLost(ConnectionId connection, const Status& reason) override {
    std::lock_guard<std::mutex> lock(mutex_);
    lost_[connection] = reason;
  }

  void StallHealth(bool stall) {
    std::lock_guard<std::mutex> lock(mutex_);
    stall_health_ = stall;
    released_.notify_all();
  }
  template <typename T>
  T Read(T TestHandler::*member) {
    std::lock_guard<std::mutex> lock(mutex_);
    return this->*member;
  }

  std::mutex mutex_;
  std::condition_variable released_;
  bool stall_health_ = false;
  std::vector<HelloRequest> hellos_;
  std::vector<uint64_t> closed_sessions_;
  std::vector<std::string> shutdown_reasons_;
  std::map<ConnectionId, Status> lost_;
};

class RpcTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(); }
  void TearDown() override {
    handler_.StallHealth(false);
    if (server_) server_->Stop();
  }

  // `auth_failure_delay_ms`: how long a Hello without `auth_token` waits for its answer.
  void StartServer(uint16_t port = 0, int peer_timeout_ms = 5000,
                   const std::string& auth_token = "", int auth_failure_delay_ms = 1000) {
    RpcServerOptions options;
    options.port = port;
    options.auth_token = auth_token;
    options.auth_failure_delay_ms = auth_failure_delay_ms;
    if (auth_failures_ == nullptr) {
      auth_failures_ = metrics_.AddCounter("test_auth_failures_total", "refused Hellos").value();
    }
    options.auth_failures = auth_failures_;
    options.model_shape = TestShape();
    options.peer_timeout_ms = peer_timeout_ms;
    server_options_ = options;
    Result<std::unique_ptr<RpcServer>> server = RpcServer::Start(options, &handler_);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    ASSERT_NE(server_->port(), 0);
  }

  static RpcClientOptions FastOptions() {
    RpcClientOptions options;
    options.call_timeout_ms = 3000;
    options.heartbeat_ms = 50;
    options.peer_timeout_ms = 2000;
    return options;
  }

  std::unique_ptr<RpcClient> Connect(const RpcClientOptions& options = FastOptions(),
                                     bool hello = true) {
    Result<std::unique_ptr<RpcClient>> client =
        RpcClient::Connect(server_->endpoint(), kBound, options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    if (!client.ok()) return nullptr;
    if (hello) {
      Result<HelloResponse> response = (*client)->Hello(GoodHello());
      EXPECT_TRUE(response.ok()) << response.status().ToString();
    }
    return std::move(client).value();
  }

  // A raw TCP socket to the server whose reads give up after kBound.
  std::unique_ptr<tcp::socket> RawSocket() {
    auto socket = std::make_unique<tcp::socket>(raw_io_);
    socket->connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), server_->port()));
    timeval bound{static_cast<time_t>(kBound.count() / 1000), 0};
    setsockopt(socket->native_handle(), SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
    return socket;
  }

  // Everything the server sends on `socket` until it closes it (or kBound passes: then the
  // returned flag is false).
  static std::pair<std::vector<Envelope>, bool> ReadUntilClosed(tcp::socket* socket) {
    FrameDecoder decoder;
    std::vector<Envelope> received;
    std::array<char, 4096> buffer;
    for (;;) {
      boost::system::error_code ec;
      const size_t n = socket->read_some(asio::buffer(buffer), ec);
      if (ec == asio::error::eof || ec == asio::error::connection_reset) return {received, true};
      if (ec) return {received, false};
      EXPECT_TRUE(decoder.Feed(std::string_view(buffer.data(), n), &received).ok());
    }
  }

  // Declared before the server, which increments auth_failures_: destroyed after it.
  MetricsRegistry metrics_;
  Counter* auth_failures_ = nullptr;
  TestHandler handler_;
  RpcServerOptions server_options_;
  std::unique_ptr<RpcServer> server_;
  asio::io_context raw_io_;
};

}  // namespace rubato::rpc::test_support
