// Liveness tests of the RPC control plane, in-process on 127.0.0.1: heartbeats keep an idle
// connection alive on both sides, the server notices a silent or departed client
// (OnConnectionLost), the client notices a silent server (like a SIGSTOPped process) or a
// stopped one and fails pending and later calls fast, a restarted server on the same port is
// reachable by a new client and after Reconnect, connect errors say what is wrong, and an
// abandoned client gives up its connect and calls at once.
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "transport/rpc/rpc_test_fixture.h"

namespace rubato::rpc {
namespace {

using namespace test_support;  // NOLINT(google-build-using-namespace): the fixture's names

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

TEST_F(RpcTest, AClientsSlowerHeartbeatRaisesTheServersPeerTimeout) {
  // The server's own timeout (150 ms) is shorter than the client's heartbeat (250 ms): the
  // client's Hello says so, and the server waits 5 of its heartbeats instead.
  server_->Stop();
  StartServer(0, /*peer_timeout_ms=*/150);
  RpcClientOptions options = FastOptions();
  options.heartbeat_ms = 250;
  auto client = Connect(options);
  ASSERT_NE(client, nullptr);
  std::this_thread::sleep_for(milliseconds(900));
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

TEST_F(RpcTest, AnAbandonedClientGivesUpItsConnectAndCallsAtOnce) {
  // A listener that never accepts, with a backlog of 0: the first connection waits in its queue
  // (connected, never answered: a stalled peer), later connects hang.
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  acceptor.listen(0);
  const std::string endpoint =
      "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port());
  std::atomic<bool> abandon{false};
  RpcClientOptions options = FastOptions();
  // Deadlines and heartbeats that never end the waits within the test: only abandon does.
  options.call_timeout_ms = 600000;
  options.heartbeat_ms = 60000;
  options.peer_timeout_ms = 600000;
  options.abandon = &abandon;
  Result<std::unique_ptr<RpcClient>> silent = RpcClient::Connect(endpoint, kBound, options);
  ASSERT_TRUE(silent.ok()) << silent.status().ToString();
  auto hello = std::async(std::launch::async, [&] { return (*silent)->Hello(GoodHello()); });
  std::vector<std::unique_ptr<RpcClient>> queued;
  auto connects = std::async(std::launch::async, [&]() -> Status {
    for (int attempt = 0; attempt < 8; ++attempt) {
      Result<std::unique_ptr<RpcClient>> client =
          RpcClient::Connect(endpoint, milliseconds(600000), options);
      if (!client.ok()) return client.status();
      queued.push_back(std::move(client).value());
    }
    return Status::Ok();
  });
  std::this_thread::sleep_for(milliseconds(200));  // lets both start waiting (not required)
  abandon = true;
  ASSERT_EQ(hello.wait_for(kBound), std::future_status::ready) << "the call waited on";
  const Status refused = hello.get().status();
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.ToString();
  EXPECT_TRUE(Contains(refused.message(), "given up")) << refused.message();
  ASSERT_EQ(connects.wait_for(kBound), std::future_status::ready) << "the connect waited on";
  const Status connected = connects.get();
  EXPECT_FALSE(connected.ok()) << "8 connections to a backlog-0 listener all succeeded";
  EXPECT_EQ(connected.code(), StatusCode::kUnavailable) << connected.ToString();
  EXPECT_TRUE(Contains(connected.message(), "given up")) << connected.message();
  // Later calls fail at once too.
  EXPECT_EQ((*silent)->Stats().status().code(), StatusCode::kUnavailable);
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
