// Tests of the RPC calls (rpc_server.h, rpc_client.h), in-process on 127.0.0.1: every call
// round-trips through a test handler, handler errors keep code and message, Hello mismatches
// name the field, requests before Hello are refused, bad bytes from a raw socket get an Error
// frame and a closed connection while other clients keep working, a stalled handler gives
// kDeadlineExceeded, and concurrent calls from several threads get their own answers.
// Liveness (heartbeats, lost peers, restarts, connect errors) is in rpc_liveness_test.cc.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "transport/rpc/rpc_auth.h"
#include "transport/rpc/rpc_test_fixture.h"

namespace rubato::rpc {
namespace {

using namespace test_support;  // NOLINT(google-build-using-namespace): the fixture's names

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

TEST_F(RpcTest, ATokenServerRefusesHellosWithoutItsToken) {
  server_->Stop();
  StartServer(0, 5000, "s3cret-token", /*auth_failure_delay_ms=*/50);
  auto client = Connect(FastOptions(), /*hello=*/false);
  ASSERT_NE(client, nullptr);
  Result<HelloResponse> refused = client->Hello(GoodHello());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(refused.status().message(), "authentication failed"));
  EXPECT_TRUE(Contains(refused.status().message(), "carries none"));
  // The refusal ends the connection (the client knows at once): no second guess on it.
  EXPECT_FALSE(client->Healthy());
  EXPECT_EQ(client->Hello(GoodHello()).status().code(), StatusCode::kUnavailable);

  auto guesser = Connect(FastOptions(), /*hello=*/false);
  ASSERT_NE(guesser, nullptr);
  HelloRequest wrong = GoodHello();
  wrong.set_auth_token("s3cret-tokeN");
  refused = guesser->Hello(wrong);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(Contains(refused.status().message(), "carries another"));
  EXPECT_FALSE(Contains(refused.status().message(), "s3cret"));  // never echoed
  EXPECT_EQ(guesser->Stats().status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(handler_.Read(&TestHandler::hellos_).empty());
  EXPECT_EQ(auth_failures_->Value(), 2.0);

  RpcClientOptions with_token = FastOptions();
  with_token.auth_token = "s3cret-token";
  auto authenticated = Connect(with_token);
  ASSERT_NE(authenticated, nullptr);
  EXPECT_TRUE(authenticated->Stats().ok());
  EXPECT_EQ(auth_failures_->Value(), 2.0);
}

// Frames as one write: what a guesser pipelining its attempts sends.
std::string Frames(const std::vector<Envelope>& envelopes) {
  std::string bytes;
  for (const Envelope& envelope : envelopes) bytes += EncodeFrame(envelope).value();
  return bytes;
}

Envelope HelloWithToken(uint64_t call_id, const std::string& token) {
  Envelope envelope;
  envelope.set_call_id(call_id);
  *envelope.mutable_hello_request() = GoodHello();
  envelope.mutable_hello_request()->set_protocol_version(kProtocolVersion);
  envelope.mutable_hello_request()->set_auth_token(token);
  return envelope;
}

TEST_F(RpcTest, ARefusedHelloIsTheLastFrameOfItsConnectionThatIsRead) {
  server_->Stop();
  StartServer(0, 5000, "s3cret-token", /*auth_failure_delay_ms=*/200);
  auto raw = RawSocket();
  Envelope stats;
  stats.set_call_id(3);
  stats.mutable_stats_request();
  // A wrong guess, the right token and a request, pipelined: only the first is read.
  const std::string bytes =
      Frames({HelloWithToken(1, "guess-1"), HelloWithToken(2, "s3cret-token"), stats});
  const auto sent = Clock::now();
  asio::write(*raw, asio::buffer(bytes));
  auto [received, closed] = ReadUntilClosed(raw.get());
  const auto answered = Clock::now();
  EXPECT_TRUE(closed);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].call_id(), 1u);
  ASSERT_TRUE(received[0].has_error());
  EXPECT_TRUE(received[0].error().closes_connection());
  EXPECT_TRUE(Contains(received[0].error().message(), "authentication failed"));
  EXPECT_GE(answered - sent, milliseconds(200));  // the answer waits for the delay
  EXPECT_EQ(auth_failures_->Value(), 1.0);
  EXPECT_TRUE(handler_.Read(&TestHandler::hellos_).empty());
  EXPECT_TRUE(WaitFor([&] { return server_->num_connections() == 0; }));
}

TEST_F(RpcTest, AClientWithTheTokenIsServedWhileARefusalWaits) {
  // A delay no step of this test comes near: the refusal is still pending when it ends (Stop
  // in TearDown cancels it).
  server_->Stop();
  StartServer(0, 5000, "s3cret-token", /*auth_failure_delay_ms=*/60000);
  auto raw = RawSocket();
  asio::write(*raw, asio::buffer(Frames({HelloWithToken(1, "guess-1")})));
  ASSERT_TRUE(WaitFor([&] { return auth_failures_->Value() == 1.0; }));

  RpcClientOptions with_token = FastOptions();
  with_token.auth_token = "s3cret-token";
  auto authenticated = Connect(with_token);
  ASSERT_NE(authenticated, nullptr);
  EXPECT_TRUE(authenticated->Stats().ok());
  EXPECT_TRUE(authenticated->Health().ok());
  // ... while the guesser still has no answer and its connection is open.
  boost::system::error_code ec;
  raw->non_blocking(true);
  std::array<char, 64> buffer;
  raw->read_some(asio::buffer(buffer), ec);
  EXPECT_EQ(ec, asio::error::would_block) << ec.message();
  EXPECT_EQ(server_->num_connections(), 2u);
}

TEST_F(RpcTest, AHeartbeatIntervalPastTheBoundIsRefused) {
  auto client = Connect(FastOptions(), /*hello=*/false);
  ASSERT_NE(client, nullptr);
  HelloRequest slow = GoodHello();
  slow.set_heartbeat_ms(4000000000u);  // ~46 days of silence before the peer counts as lost
  Result<HelloResponse> refused = client->Hello(slow);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(Contains(refused.status().message(), "heartbeat_ms 4000000000"));
  slow.set_heartbeat_ms(60000);
  EXPECT_TRUE(client->Hello(slow).ok());
}

TEST(RpcAuth, TokensCompareByEveryByte) {
  EXPECT_TRUE(TokensEqual("abc", "abc"));
  EXPECT_TRUE(TokensEqual("", ""));
  EXPECT_FALSE(TokensEqual("abc", "abd"));
  EXPECT_FALSE(TokensEqual("abc", "ab"));
  EXPECT_FALSE(TokensEqual("", "a"));
  EXPECT_FALSE(TokensEqual(std::string("a\0b", 3), std::string("a\0c", 3)));
}

TEST(RpcAuth, TokenFromTheEnvironmentOrAFile) {
  unsetenv(kTokenEnv);
  unsetenv(kTokenFileEnv);
  EXPECT_EQ(AuthTokenFromEnvironment().value(), "");
  setenv(kTokenEnv, "from-env", 1);
  EXPECT_EQ(AuthTokenFromEnvironment().value(), "from-env");
  unsetenv(kTokenEnv);
  char path[] = "/tmp/rubato_token_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "  from-file\n", 12), 12);
  close(fd);
  setenv(kTokenFileEnv, path, 1);
  EXPECT_EQ(AuthTokenFromEnvironment().value(), "from-file");
  const int truncated = open(path, O_WRONLY | O_TRUNC);
  close(truncated);
  const Result<std::string> empty = AuthTokenFromEnvironment();
  EXPECT_FALSE(empty.ok());
  EXPECT_TRUE(Contains(empty.status().message(), "holds no token"));
  setenv(kTokenFileEnv, "/dev/zero", 1);
  EXPECT_FALSE(AuthTokenFromEnvironment().ok());
  unsetenv(kTokenFileEnv);
  unlink(path);
  const Result<std::string> drawn = RandomAuthToken();
  ASSERT_TRUE(drawn.ok());
  EXPECT_EQ(drawn->size(), 64u);
  EXPECT_NE(*drawn, RandomAuthToken().value());
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

TEST(RpcClientOptionsTest, FromLimitsTakesTheConfigAndFiveHeartbeatsOfPeerTimeout) {
  LimitsSection limits;
  limits.rpc_timeout_ms = 1234;
  limits.heartbeat_ms = 200;
  const RpcClientOptions options = RpcClientOptions::FromLimits(limits);
  EXPECT_EQ(options.call_timeout_ms, 1234);
  EXPECT_EQ(options.heartbeat_ms, 200);
  EXPECT_EQ(options.peer_timeout_ms, 1000);
}

TEST(RpcEndpointTest, ParsesHostAndPortIncludingBracketedIpv6) {
  Result<RpcEndpoint> v4 = ParseRpcEndpoint("10.0.0.7:7000");
  ASSERT_TRUE(v4.ok()) << v4.status().ToString();
  EXPECT_EQ(v4->host, "10.0.0.7");
  EXPECT_EQ(v4->port, 7000);
  Result<RpcEndpoint> dns = ParseRpcEndpoint("cache-0.rubato.svc:65535");
  ASSERT_TRUE(dns.ok());
  EXPECT_EQ(dns->host, "cache-0.rubato.svc");
  EXPECT_EQ(dns->port, 65535);
  Result<RpcEndpoint> v6 = ParseRpcEndpoint("[::1]:1");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 1);
  const Result<RpcEndpoint> bad = ParseRpcEndpoint("cache-0:http");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "RPC endpoint 'cache-0:http': port 'http' is not a number in [1, 65535] "
            "(expected host:port, e.g. 127.0.0.1:7000)");
}

}  // namespace
}  // namespace rubato::rpc
