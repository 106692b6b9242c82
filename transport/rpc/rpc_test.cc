// Tests of the RPC control plane (rpc_server.h, rpc_client.h), all in-process with the server
// on 127.0.0.1 and an OS-chosen port: every call round-trips through a test handler, handler
// errors keep code and message, Hello mismatches name the field, bad bytes from a raw socket
// get an Error frame and a closed connection while other clients keep working, deadlines,
// peer loss on both sides (silent peer, stopped server), restart on the same port, and
// concurrent calls from several threads. Every wait is bounded (kBound); no timing thresholds.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/time.h>

#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/rpc/rpc_client.h"
#include "transport/rpc/rpc_frame.h"
#include "transport/rpc/rpc_server.h"

namespace rubato::rpc {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr milliseconds kBound{5000};  // upper bound of every wait; never a timing threshold

bool WaitFor(const std::function<bool()>& condition, milliseconds bound = kBound) {
  const auto deadline = Clock::now() + bound;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return condition();
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

ModelShape TestShape() {
  ModelShape shape;
  shape.set_num_layers(36);
  shape.set_num_kv_heads(8);
  shape.set_num_query_heads(32);
  shape.set_head_dim(128);
  shape.set_kv_dtype("bf16");
  return shape;
}

HelloRequest GoodHello() {
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

  void StartServer(uint16_t port = 0, int peer_timeout_ms = 5000) {
    RpcServerOptions options;
    options.port = port;
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

  TestHandler handler_;
  RpcServerOptions server_options_;
  std::unique_ptr<RpcServer> server_;
  asio::io_context raw_io_;
};

TEST_F(RpcTest, EveryCallRoundTrips) {
  auto client = Connect(FastOptions(), /*hello=*/false);
  ASSERT_NE(client, nullptr);

  Result<HelloResponse> hello = client->Hello(GoodHello());
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->protocol_version(), kProtocolVersion);
  EXPECT_EQ(hello->role(), ROLE_CACHE);
  EXPECT_EQ(hello->rank(), 7u);
  EXPECT_EQ(hello->model_shape().num_kv_heads(), 8u);
  EXPECT_EQ(hello->transport_backend(), "ucx");
  EXPECT_EQ(hello->transport_address(), "cache-address");
  const auto hellos = handler_.Read(&TestHandler::hellos_);
  ASSERT_EQ(hellos.size(), 1u);
  EXPECT_EQ(hellos[0].protocol_version(), kProtocolVersion);  // filled in by the client
  EXPECT_EQ(hellos[0].rank(), 2u);
  EXPECT_EQ(hellos[0].transport_address(), std::string("\x01\x00\xfe worker", 10));

  OpenSessionRequest open;
  open.set_request_id(42);
  open.set_num_layers(36);
  open.set_num_kv_heads(8);
  open.set_head_dim(128);
  open.set_dtype("bf16");
  open.set_capacity_tokens(32768);
  Result<OpenSessionResponse> session = client->OpenSession(open);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  EXPECT_EQ(session->session_id(), 1042u);
  EXPECT_EQ(session->bytes_reserved(), 2ull * 36 * 8 * 128 * 32768 * 2);

  CloseSessionRequest close;
  close.set_session_id(1042);
  ASSERT_TRUE(client->CloseSession(close).ok());
  EXPECT_EQ(handler_.Read(&TestHandler::closed_sessions_), std::vector<uint64_t>{1042});

  Result<StatsResponse> stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->sessions_open(), 3u);
  EXPECT_EQ(stats->bytes_in_use(), 4096u);
  EXPECT_EQ(stats->bytes_capacity(), 1u << 20);
  EXPECT_EQ(stats->counters().at("appends_total"), 12.5);
  EXPECT_EQ(stats->counters().at("connection"), 1.0);  // the first connection of the server

  Result<HealthResponse> health = client->Health();
  ASSERT_TRUE(health.ok()) << health.status().ToString();
  EXPECT_EQ(health->status(), "ok");
  EXPECT_EQ(health->uptime_s(), 1.5);

  ShutdownRequest shutdown;
  shutdown.set_reason("test over");
  ASSERT_TRUE(client->Shutdown(shutdown).ok());
  EXPECT_EQ(handler_.Read(&TestHandler::shutdown_reasons_), std::vector<std::string>{"test over"});
  EXPECT_TRUE(client->Healthy());
  EXPECT_TRUE(client->LostReason().ok());
}

TEST_F(RpcTest, HandlerErrorComesBackWithItsCodeAndMessage) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  OpenSessionRequest open;
  open.set_request_id(1);
  open.set_capacity_tokens(0);
  Result<OpenSessionResponse> session = client->OpenSession(open);
  ASSERT_FALSE(session.ok());
  EXPECT_EQ(session.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(session.status().message(), "open session: capacity_tokens is 0, need at least 1");
  EXPECT_TRUE(client->Healthy());  // an error answer is not a lost peer
  EXPECT_TRUE(client->Stats().ok());
}

TEST_F(RpcTest, RequestsBeforeHelloAreRefused) {
  auto client = Connect(FastOptions(), /*hello=*/false);
  ASSERT_NE(client, nullptr);
  Result<StatsResponse> stats = client->Stats();
  ASSERT_FALSE(stats.ok());
  EXPECT_EQ(stats.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(stats.status().message(), "call Hello first")) << stats.status().message();
  ASSERT_TRUE(client->Hello(GoodHello()).ok());
  EXPECT_TRUE(client->Stats().ok());
}

TEST_F(RpcTest, HelloMismatchesAreRefusedNamingTheField) {
  auto client = Connect(FastOptions(), /*hello=*/false);
  ASSERT_NE(client, nullptr);

  HelloRequest version = GoodHello();
  version.set_protocol_version(kProtocolVersion + 1);
  Result<HelloResponse> refused = client->Hello(version);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.status().message(),
            "protocol version mismatch: protocol_version is 1 here, 2 in the peer's Hello");

  HelloRequest role = GoodHello();
  role.set_role(ROLE_CACHE);
  refused = client->Hello(role);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(Contains(refused.status().message(), "role mismatch"));
  EXPECT_TRUE(Contains(refused.status().message(), "ROLE_CACHE"));

  HelloRequest heads = GoodHello();
  heads.mutable_model_shape()->set_num_kv_heads(4);
  refused = client->Hello(heads);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "model shape mismatch: num_kv_heads is 8 here, 4 in the peer's Hello");

  HelloRequest dtype = GoodHello();
  dtype.mutable_model_shape()->set_kv_dtype("f32");
  refused = client->Hello(dtype);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "model shape mismatch: kv_dtype is 'bf16' here, 'f32' in the peer's Hello");

  // Refused Hellos leave the connection usable but not introduced.
  EXPECT_EQ(client->Stats().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(client->Hello(GoodHello()).ok());
  EXPECT_TRUE(handler_.Read(&TestHandler::hellos_).size() == 1u);  // only the good one
}

TEST_F(RpcTest, GarbageBytesGetAnErrorFrameAndTheConnectionClosed) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  auto raw = RawSocket();
  asio::write(*raw, asio::buffer(std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n")));
  auto [received, closed] = ReadUntilClosed(raw.get());
  EXPECT_TRUE(closed) << "the server did not close the connection within the bound";
  ASSERT_EQ(received.size(), 1u);
  ASSERT_TRUE(received[0].has_error());
  EXPECT_EQ(received[0].error().code(), DATA_LOSS);
  EXPECT_TRUE(Contains(received[0].error().message(), "bad magic 'GET '"))
      << received[0].error().message();
  // The other client is still served, and the handler heard of the closed connection.
  EXPECT_TRUE(client->Stats().ok());
  EXPECT_TRUE(client->Healthy());
  EXPECT_TRUE(WaitFor([&] { return handler_.Read(&TestHandler::lost_).count(2) == 1; }));
}

TEST_F(RpcTest, FourGigabyteLengthGetsAnErrorFrameAndTheConnectionClosed) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  auto raw = RawSocket();
  asio::write(*raw, asio::buffer(std::string("RBRP\xff\xff\xff\xff", 8)));
  auto [received, closed] = ReadUntilClosed(raw.get());
  EXPECT_TRUE(closed);
  ASSERT_EQ(received.size(), 1u);
  ASSERT_TRUE(received[0].has_error());
  EXPECT_EQ(received[0].error().code(), OUT_OF_RANGE);
  EXPECT_TRUE(Contains(received[0].error().message(), "payload length 4294967295 bytes"))
      << received[0].error().message();
  EXPECT_TRUE(client->Stats().ok());
}

TEST_F(RpcTest, UnparsablePayloadGetsAnErrorFrameAndTheConnectionClosed) {
  auto raw = RawSocket();
  asio::write(*raw, asio::buffer(std::string("RBRP\x08\x00\x00\x00", 8) + std::string(8, '\xff')));
  auto [received, closed] = ReadUntilClosed(raw.get());
  EXPECT_TRUE(closed);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_TRUE(Contains(received[0].error().message(), "does not parse"));
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->Health().ok());
}

TEST_F(RpcTest, ServerAnswersRawHeartbeatsWithTheSameSequence) {
  auto raw = RawSocket();
  Envelope heartbeat;
  heartbeat.mutable_heartbeat()->set_sequence(77);
  asio::write(*raw, asio::buffer(*EncodeFrame(heartbeat)));
  FrameDecoder decoder;
  std::vector<Envelope> received;
  std::array<char, 256> buffer;
  while (received.empty()) {
    boost::system::error_code ec;
    const size_t n = raw->read_some(asio::buffer(buffer), ec);
    ASSERT_FALSE(ec) << ec.message();
    ASSERT_TRUE(decoder.Feed(std::string_view(buffer.data(), n), &received).ok());
  }
  ASSERT_TRUE(received[0].has_heartbeat());
  EXPECT_EQ(received[0].heartbeat().sequence(), 77u);
  EXPECT_TRUE(received[0].heartbeat().reply());
}

TEST_F(RpcTest, StalledHandlerGivesDeadlineExceededAndTheClientStaysUsable) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  handler_.StallHealth(true);
  const auto start = Clock::now();
  Result<HealthResponse> health = client->Health(milliseconds(100));
  const auto waited = Clock::now() - start;
  handler_.StallHealth(false);
  ASSERT_FALSE(health.ok());
  EXPECT_EQ(health.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(Contains(health.status().message(), "100 ms")) << health.status().message();
  // Bounded: the call returned before the handler was released (which happens after kBound).
  EXPECT_LT(waited, kBound);
  // The late answer is dropped; the client keeps working.
  EXPECT_TRUE(client->Healthy());
  EXPECT_TRUE(client->Stats().ok());
  EXPECT_TRUE(client->Health().ok());
}

TEST_F(RpcTest, ConcurrentCallsFromSeveralThreadsGetTheirOwnAnswers) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  constexpr int kThreads = 4;
  constexpr int kCallsPerThread = 50;
  std::atomic<int> mismatches{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCallsPerThread; ++i) {
        OpenSessionRequest open;
        open.set_request_id(static_cast<uint64_t>(t * 1000000 + i));
        open.set_capacity_tokens(1);
        Result<OpenSessionResponse> session = client->OpenSession(open);
        if (!session.ok()) {
          ++failures;
        } else if (session->session_id() != open.request_id() + 1000) {
          ++mismatches;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(RpcTest, HeartbeatsKeepAnIdleConnectionAliveOnBothSides) {
  server_->Stop();
  StartServer(0, /*peer_timeout_ms=*/400);
  RpcClientOptions options = FastOptions();
  options.peer_timeout_ms = 400;
  auto client = Connect(options);
  ASSERT_NE(client, nullptr);
  // Idle for several peer timeouts: only heartbeats (50 ms apart) flow.
  std::this_thread::sleep_for(milliseconds(1200));
  EXPECT_TRUE(client->Healthy()) << client->LostReason().ToString();
  EXPECT_TRUE(handler_.Read(&TestHandler::lost_).empty());
  EXPECT_TRUE(client->Stats().ok());
}

TEST_F(RpcTest, ServerNoticesASilentClient) {
  server_->Stop();
  StartServer(0, /*peer_timeout_ms=*/300);
  auto raw = RawSocket();  // connects, then sends nothing at all
  ASSERT_TRUE(WaitFor([&] { return handler_.Read(&TestHandler::lost_).count(1) == 1; }));
  const Status reason = handler_.Read(&TestHandler::lost_).at(1);
  EXPECT_EQ(reason.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(reason.message(), "sent nothing")) << reason.message();
  EXPECT_TRUE(Contains(reason.message(), "300 ms")) << reason.message();
  auto [received, closed] = ReadUntilClosed(raw.get());
  EXPECT_TRUE(closed);
  EXPECT_TRUE(received.empty());
}

TEST_F(RpcTest, ServerTellsTheHandlerWhenAClientDisconnects) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  client->Close();
  ASSERT_TRUE(WaitFor([&] { return handler_.Read(&TestHandler::lost_).count(1) == 1; }));
  EXPECT_TRUE(Contains(handler_.Read(&TestHandler::lost_).at(1).message(), "closed by the peer"));
  EXPECT_EQ(client->Stats().status().code(), StatusCode::kUnavailable);
}

TEST_F(RpcTest, SilentServerMakesTheClientUnhealthyWithinThePeerTimeout) {
  // A fake server that accepts and reads but never answers (like a SIGSTOPped process whose
  // kernel still holds the TCP connection).
  asio::io_context fake_io;
  tcp::acceptor acceptor(fake_io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  const uint16_t port = acceptor.local_endpoint().port();
  std::atomic<bool> stop_reading{false};
  std::thread fake_server([&] {
    tcp::socket socket(fake_io);
    acceptor.accept(socket);
    socket.non_blocking(true);
    std::array<char, 4096> sink;
    while (!stop_reading) {
      boost::system::error_code ec;
      socket.read_some(asio::buffer(sink), ec);
      if (ec && ec != asio::error::would_block) break;
      std::this_thread::sleep_for(milliseconds(5));
    }
  });
  // Ends the fake server on every way out of this test (its accept() returns at connect).
  struct JoinFakeServer {
    std::atomic<bool>* stop;
    std::thread* thread;
    uint16_t port;
    ~JoinFakeServer() {
      *stop = true;
      // Unblocks accept() in case the client never connected (harmless otherwise).
      asio::io_context io;
      tcp::socket unblock(io);
      boost::system::error_code ignored;
      unblock.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port), ignored);
      thread->join();
    }
  } join_fake_server{&stop_reading, &fake_server, port};
  RpcClientOptions options = FastOptions();
  options.heartbeat_ms = 50;
  options.peer_timeout_ms = 300;
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  Result<std::unique_ptr<RpcClient>> client = RpcClient::Connect(endpoint, kBound, options);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  // A call in flight when the peer is declared lost fails fast with kUnavailable, not at its
  // (much later) deadline.
  auto pending =
      std::async(std::launch::async, [&] { return (*client)->Stats(milliseconds(10000)); });
  const bool pending_done = pending.wait_for(kBound) == std::future_status::ready;
  EXPECT_TRUE(pending_done);
  EXPECT_TRUE(WaitFor([&] { return !(*client)->Healthy(); }));
  const Status reason = (*client)->LostReason();
  EXPECT_EQ(reason.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(reason.message(), endpoint)) << reason.message();
  EXPECT_TRUE(Contains(reason.message(), "sent nothing")) << reason.message();
  if (pending_done) {
    EXPECT_EQ(pending.get().status().code(), StatusCode::kUnavailable);
  }
  Result<HealthResponse> later = (*client)->Health(milliseconds(10000));
  EXPECT_EQ(later.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(later.status().message(), reason.message());
  (*client)->Close();
}

TEST_F(RpcTest, StoppedServerMakesTheClientUnhealthy) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  server_->Stop();
  ASSERT_TRUE(WaitFor([&] { return !client->Healthy(); }));
  EXPECT_EQ(client->LostReason().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(client->LostReason().message(), server_->endpoint()));
  EXPECT_EQ(client->Stats().status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(handler_.Read(&TestHandler::lost_).empty());  // Stop() is not a lost connection
  server_->Stop();  // a second Stop is harmless
}

TEST_F(RpcTest, RestartedServerOnTheSamePortIsReachable) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  const uint16_t port = server_->port();
  server_->Stop();
  server_.reset();
  ASSERT_TRUE(WaitFor([&] { return !client->Healthy(); }));
  StartServer(port);
  ASSERT_EQ(server_->port(), port);
  // A new client...
  auto fresh = Connect();
  ASSERT_NE(fresh, nullptr);
  EXPECT_TRUE(fresh->Stats().ok());
  // ...and the old one after Reconnect (which needs a new Hello).
  ASSERT_TRUE(client->Reconnect(kBound).ok());
  EXPECT_TRUE(client->Healthy());
  EXPECT_EQ(client->Stats().status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client->Hello(GoodHello()).ok());
  EXPECT_TRUE(client->Stats().ok());
}

TEST_F(RpcTest, ConnectErrorsSayWhatIsWrong) {
  for (const char* bad : {"127.0.0.1", "127.0.0.1:", ":7000", "127.0.0.1:99999",
                          "127.0.0.1:70a", "127.0.0.1:0"}) {
    Result<std::unique_ptr<RpcClient>> client = RpcClient::Connect(bad, kBound, FastOptions());
    ASSERT_FALSE(client.ok()) << bad;
    EXPECT_EQ(client.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(Contains(client.status().message(), std::string("'") + bad + "'"))
        << client.status().message();
  }
  // A port nobody listens on: the stopped server's.
  const std::string endpoint = server_->endpoint();
  server_->Stop();
  Result<std::unique_ptr<RpcClient>> refused =
      RpcClient::Connect(endpoint, kBound, FastOptions());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(refused.status().message(), endpoint)) << refused.status().message();
  EXPECT_TRUE(Contains(refused.status().message(), "refused")) << refused.status().message();

  RpcClientOptions zero_heartbeat = FastOptions();
  zero_heartbeat.heartbeat_ms = 0;
  EXPECT_EQ(RpcClient::Connect("127.0.0.1:1", kBound, zero_heartbeat).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(RpcTest, ConnectToAFullListenQueueTimesOut) {
  // A listener that never accepts, with a backlog of 0: once its accept queue is full, Linux
  // drops further SYNs and connect() hangs, which is what an unreachable host looks like.
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  acceptor.listen(0);
  const std::string endpoint =
      "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port());
  std::vector<std::unique_ptr<RpcClient>> queued;  // connected, never accepted
  Status timed_out;
  for (int attempt = 0; attempt < 8 && timed_out.ok(); ++attempt) {
    Result<std::unique_ptr<RpcClient>> client =
        RpcClient::Connect(endpoint, milliseconds(200), FastOptions());
    if (client.ok()) {
      queued.push_back(std::move(client).value());
    } else {
      timed_out = client.status();
    }
  }
  ASSERT_FALSE(timed_out.ok()) << "8 connections to a backlog-0 listener all succeeded";
  EXPECT_EQ(timed_out.code(), StatusCode::kDeadlineExceeded) << timed_out.ToString();
  EXPECT_TRUE(Contains(timed_out.message(), endpoint)) << timed_out.message();
  EXPECT_TRUE(Contains(timed_out.message(), "200 ms")) << timed_out.message();
}

TEST_F(RpcTest, ServerRefusesBadOptions) {
  RpcServerOptions options;
  options.host = "not-an-ip";
  Result<std::unique_ptr<RpcServer>> server = RpcServer::Start(options, &handler_);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(server.status().message(), "not-an-ip"));

  RpcServerOptions taken;  // the port of the running server, without SO_REUSEPORT: refused
  taken.port = server_->port();
  server = RpcServer::Start(taken, &handler_);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(server.status().message(), std::to_string(server_->port())));
}

}  // namespace
}  // namespace rubato::rpc
