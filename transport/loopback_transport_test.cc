// Tests for the loopback transport and the op validation every backend shares: round trips of
// 0 B .. 65 MB byte for byte, in-order delivery per (peer, tag) and independence across tags,
// either posting order, grouped Posts, every invalid op refused with its index, exact sizes
// (kDataLoss naming both sizes), Wait's deadline, Cancel, closed peers, Stats, two threads.
#include "transport/loopback_transport.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace rubato::transport {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kWait(5000);

// Bytes whose value depends on the position and a seed, so a misplaced or stale byte shows.
std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> data(bytes);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < bytes; ++i) {
    x = x * 1664525u + 1013904223u;
    data[i] = static_cast<uint8_t>(x >> 24);
  }
  return data;
}

// A hub of `world` ranks and an endpoint per rank.
struct Ranks {
  explicit Ranks(int world) {
    auto created = LoopbackHub::Create(world);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    hub = std::move(created).value();
    for (int r = 0; r < world; ++r) {
      auto endpoint = hub->Endpoint(r);
      EXPECT_TRUE(endpoint.ok()) << endpoint.status().ToString();
      endpoints.push_back(std::move(endpoint).value());
    }
  }
  Transport& operator[](int rank) { return *endpoints[static_cast<size_t>(rank)]; }

  std::unique_ptr<LoopbackHub> hub;
  std::vector<std::unique_ptr<Transport>> endpoints;
};

TransferId PostOk(Transport& t, std::vector<TransferOp> ops) {
  auto id = t.Post(ops);
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  return id.ok() ? *id : 0;
}

TEST(LoopbackTransport, RoundTripsEverySizeByteForByte) {
  Ranks ranks(2);
  EXPECT_EQ(ranks[0].BackendName(), "loopback");
  EXPECT_EQ(ranks[1].Rank(), 1);
  EXPECT_EQ(ranks[1].WorldSize(), 2);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4097}, size_t{1} << 20,
                       (size_t{65} << 20) + 3}) {
    const std::vector<uint8_t> sent = Pattern(bytes, static_cast<uint32_t>(bytes));
    std::vector<uint8_t> received(bytes, 0);
    const TransferId recv =
        PostOk(ranks[1], {TransferOp::Recv(0, 3, bytes ? received.data() : nullptr, bytes)});
    const TransferId send =
        PostOk(ranks[0], {TransferOp::Send(1, 3, bytes ? sent.data() : nullptr, bytes)});
    ASSERT_TRUE(ranks[0].Wait(send, kWait).ok()) << bytes;
    ASSERT_TRUE(ranks[1].Wait(recv, kWait).ok()) << bytes;
    ASSERT_TRUE(received == sent) << "payload of " << bytes << " bytes differs";
  }
  EXPECT_FALSE(ranks[0].SupportsMemory(MemoryKind::kCuda));
  EXPECT_TRUE(ranks[0].SupportsMemory(MemoryKind::kHost));
}

TEST(LoopbackTransport, ReceivePostedAfterTheSendCompletesBoth) {
  Ranks ranks(2);
  const std::vector<uint8_t> sent = Pattern(1000, 1);
  std::vector<uint8_t> received(1000);
  const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 9, sent.data(), sent.size())});
  auto pending = ranks[0].Test(send);
  ASSERT_TRUE(pending.ok());
  EXPECT_FALSE(*pending) << "a send completes only once its receive is posted";
  const TransferId recv =
      PostOk(ranks[1], {TransferOp::Recv(0, 9, received.data(), received.size())});
  auto done = ranks[1].Test(recv);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  EXPECT_TRUE(ranks[0].Wait(send, kWait).ok());
  EXPECT_EQ(received, sent);
  // Reported done: the ids are released.
  EXPECT_EQ(ranks[1].Test(recv).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ranks[0].Wait(send, kWait).code(), StatusCode::kInvalidArgument);
}

TEST(LoopbackTransport, InOrderPerTagAndIndependentAcrossTags) {
  Ranks ranks(2);
  std::vector<std::vector<uint8_t>> sent;
  for (uint32_t i = 0; i < 4; ++i) sent.push_back(Pattern(64, i));
  // Tag 1 gets messages 0 and 1, tag 2 gets 2 and 3; tag 2's are sent first.
  std::vector<TransferId> sends;
  for (int i : {2, 3, 0, 1}) {
    sends.push_back(
        PostOk(ranks[0], {TransferOp::Send(1, i < 2 ? 1 : 2, sent[size_t(i)].data(), 64)}));
  }
  std::vector<std::vector<uint8_t>> received(4, std::vector<uint8_t>(64));
  // Tag 1's receives first: they must get messages 0 and 1 in order, not tag 2's.
  std::vector<TransferId> recvs;
  for (int i : {0, 1, 2, 3}) {
    recvs.push_back(PostOk(
        ranks[1], {TransferOp::Recv(0, i < 2 ? 1 : 2, received[size_t(i)].data(), 64)}));
  }
  for (TransferId id : recvs) ASSERT_TRUE(ranks[1].Wait(id, kWait).ok());
  for (TransferId id : sends) ASSERT_TRUE(ranks[0].Wait(id, kWait).ok());
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(received[i], sent[i]) << "message " << i;
}

TEST(LoopbackTransport, MatchesBySourceRank) {
  Ranks ranks(3);
  const std::vector<uint8_t> from1 = Pattern(32, 1), from2 = Pattern(32, 2);
  std::vector<uint8_t> got1(32), got2(32);
  const TransferId recvs = PostOk(ranks[0], {TransferOp::Recv(2, 5, got2.data(), 32),
                                             TransferOp::Recv(1, 5, got1.data(), 32)});
  PostOk(ranks[1], {TransferOp::Send(0, 5, from1.data(), 32)});
  PostOk(ranks[2], {TransferOp::Send(0, 5, from2.data(), 32)});
  ASSERT_TRUE(ranks[0].Wait(recvs, kWait).ok());
  EXPECT_EQ(got1, from1);
  EXPECT_EQ(got2, from2);
}

TEST(LoopbackTransport, GroupedPostCompletesWhenEveryOpDid) {
  Ranks ranks(2);
  // One layer-pack style exchange: each side sends two buffers and receives two.
  const std::vector<uint8_t> a0 = Pattern(100, 1), a1 = Pattern(0, 2);
  const std::vector<uint8_t> b0 = Pattern(300, 3), b1 = Pattern(7, 4);
  std::vector<uint8_t> at_b0(100), at_a0(300), at_a1(7);
  const TransferId a = PostOk(ranks[0], {TransferOp::Send(1, 10, a0.data(), 100),
                                         TransferOp::Send(1, 11, nullptr, 0),
                                         TransferOp::Recv(1, 20, at_a0.data(), 300),
                                         TransferOp::Recv(1, 21, at_a1.data(), 7)});
  auto partial = ranks[0].Test(a);
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(*partial);
  const TransferId b = PostOk(ranks[1], {TransferOp::Recv(0, 10, at_b0.data(), 100),
                                         TransferOp::Send(0, 20, b0.data(), 300)});
  ASSERT_TRUE(ranks[1].Wait(b, kWait).ok()) << "rank 1's group has all its counterparts";
  partial = ranks[0].Test(a);
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(*partial) << "tags 11 and 21 are still unmatched";
  std::vector<uint8_t> at_b1;
  const TransferId c = PostOk(ranks[1], {TransferOp::Recv(0, 11, nullptr, 0),
                                         TransferOp::Send(0, 21, b1.data(), 7)});
  ASSERT_TRUE(ranks[1].Wait(c, kWait).ok());
  ASSERT_TRUE(ranks[0].Wait(a, kWait).ok());
  EXPECT_EQ(at_b0, a0);
  EXPECT_EQ(at_a0, b0);
  EXPECT_EQ(at_a1, b1);
}

// Each invalid op is refused with its index and the problem, and nothing of the group starts.
TEST(LoopbackTransport, RefusesInvalidOpsNamingTheirIndex) {
  Ranks ranks(3);
  uint8_t byte = 0;
  const TransferOp good = TransferOp::Send(1, 1, &byte, 1);
  struct Case {
    TransferOp bad;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {TransferOp::Send(3, 1, &byte, 1), "peer 3 is out of range [0, 3)"},
      {TransferOp::Recv(-1, 1, &byte, 1), "peer -1 is out of range [0, 3)"},
      {TransferOp::Send(0, 1, &byte, 1), "peer 0 is this transport's own rank"},
      {TransferOp::Send(1, kMaxTag + 1, &byte, 1), "tag 281474976710656 exceeds kMaxTag"},
      {TransferOp::Recv(1, 1, nullptr, 8), "data is null but bytes is 8"},
      {TransferOp::Send(1, 1, &byte, 1, MemoryKind::kCuda),
       "cuda memory is not supported by this loopback transport"},
  };
  for (const Case& c : cases) {
    auto id = ranks[0].Post(std::vector<TransferOp>{good, good, c.bad});
    ASSERT_FALSE(id.ok()) << c.expected;
    EXPECT_EQ(id.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(id.status().message().find("loopback: Post op 2 of 3"), std::string::npos)
        << id.status().message();
    EXPECT_NE(id.status().message().find(c.expected), std::string::npos)
        << id.status().message();
  }
  int not_an_event = 0;
  auto with_event = ranks[0].Post({{TransferOp::Send(1, 1, &byte, 1, MemoryKind::kHost,
                                                     &not_an_event)}});
  ASSERT_FALSE(with_event.ok());
  EXPECT_EQ(with_event.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(with_event.status().message().find("op 0 of 1"), std::string::npos);
  EXPECT_NE(with_event.status().message().find("ready_event is not supported"),
            std::string::npos);
  auto empty = ranks[0].Post({});
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("at least one op"), std::string::npos);
  // None of the refused groups queued its valid sends: rank 1's receive finds nothing.
  uint8_t got = 0;
  const TransferId recv = PostOk(ranks[1], {TransferOp::Recv(0, 1, &got, 1)});
  EXPECT_EQ(ranks[1].Wait(recv, milliseconds(20)).code(), StatusCode::kDeadlineExceeded);
  ranks[1].Cancel(recv);
  // The largest tag itself is valid.
  const TransferId max_tag = PostOk(ranks[0], {TransferOp::Send(1, kMaxTag, nullptr, 0)});
  PostOk(ranks[1], {TransferOp::Recv(0, kMaxTag, nullptr, 0)});
  EXPECT_TRUE(ranks[0].Wait(max_tag, kWait).ok());
}

TEST(LoopbackTransport, SizeMismatchIsDataLossNamingBothSizes) {
  Ranks ranks(2);
  const std::vector<uint8_t> sent = Pattern(100, 1);
  for (size_t buffer : {size_t{64}, size_t{128}}) {
    std::vector<uint8_t> received(buffer, 0);
    const TransferId recv = PostOk(ranks[1], {TransferOp::Recv(0, 4, received.data(), buffer)});
    const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 4, sent.data(), 100)});
    const Status status = ranks[1].Wait(recv, kWait);
    EXPECT_EQ(status.code(), StatusCode::kDataLoss) << buffer;
    const std::string expected = "receive from peer 0, tag 4: the message has 100 bytes but the "
                                 "receive buffer has " + std::to_string(buffer) + " bytes";
    EXPECT_NE(status.message().find(expected), std::string::npos) << status.message();
    EXPECT_TRUE(ranks[0].Wait(send, kWait).ok()) << "the sender cannot know the receiver's size";
  }
  EXPECT_EQ(ranks[1].Stats().transfers_failed, 2u);
  EXPECT_EQ(ranks[1].Stats().bytes_received, 0u);
}

TEST(LoopbackTransport, WaitTimesOutAndTheGroupStillCompletesLater) {
  Ranks ranks(2);
  const std::vector<uint8_t> sent = Pattern(50, 5);
  std::vector<uint8_t> received(50);
  const TransferId recv = PostOk(ranks[1], {TransferOp::Recv(0, 1, received.data(), 50)});
  const Status timed_out = ranks[1].Wait(recv, milliseconds(10));
  EXPECT_EQ(timed_out.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(timed_out.message().find("transfer " + std::to_string(recv) + " not done after 10 ms"),
            std::string::npos)
      << timed_out.message();
  const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 1, sent.data(), 50)});
  EXPECT_TRUE(ranks[1].Wait(recv, kWait).ok());
  EXPECT_TRUE(ranks[0].Wait(send, kWait).ok());
  EXPECT_EQ(received, sent);
}

TEST(LoopbackTransport, CancelTakesBackAPendingTransfer) {
  Ranks ranks(2);
  std::vector<uint8_t> cancelled(16, 0xee), received(16, 0);
  const TransferId first = PostOk(ranks[1], {TransferOp::Recv(0, 2, cancelled.data(), 16)});
  ranks[1].Cancel(first);
  ranks[1].Cancel(first);   // unknown ids are ignored
  ranks[1].Cancel(123456);  // never posted
  EXPECT_EQ(ranks[1].Test(first).status().code(), StatusCode::kInvalidArgument);
  // The next send goes to the receive posted after the cancel, not to the cancelled buffer.
  const TransferId second = PostOk(ranks[1], {TransferOp::Recv(0, 2, received.data(), 16)});
  const std::vector<uint8_t> sent = Pattern(16, 8);
  const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 2, sent.data(), 16)});
  EXPECT_TRUE(ranks[1].Wait(second, kWait).ok());
  EXPECT_TRUE(ranks[0].Wait(send, kWait).ok());
  EXPECT_EQ(received, sent);
  EXPECT_EQ(cancelled, std::vector<uint8_t>(16, 0xee));
  // A cancelled send is never delivered.
  const TransferId dropped = PostOk(ranks[0], {TransferOp::Send(1, 3, sent.data(), 16)});
  ranks[0].Cancel(dropped);
  const TransferId recv = PostOk(ranks[1], {TransferOp::Recv(0, 3, received.data(), 16)});
  EXPECT_EQ(ranks[1].Wait(recv, milliseconds(10)).code(), StatusCode::kDeadlineExceeded);
}

TEST(LoopbackTransport, ClosedPeerFailsPendingTransfers) {
  Ranks ranks(2);
  std::vector<uint8_t> received(8);
  const TransferId recv = PostOk(ranks[0], {TransferOp::Recv(1, 1, received.data(), 8)});
  ranks.endpoints[1].reset();
  const Status status = ranks[0].Wait(recv, kWait);
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("peer closed its endpoint"), std::string::npos)
      << status.message();
  const TransferId later = PostOk(ranks[0], {TransferOp::Send(1, 1, received.data(), 8)});
  EXPECT_EQ(ranks[0].Wait(later, kWait).code(), StatusCode::kUnavailable);
  EXPECT_EQ(ranks[0].Stats().transfers_failed, 2u);
  // The rank may be opened again; a second endpoint for an open rank is refused.
  auto reopened = ranks.hub->Endpoint(1);
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ(ranks.hub->Endpoint(1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ranks.hub->Endpoint(2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(LoopbackHub::Create(0).status().code(), StatusCode::kInvalidArgument);
}

TEST(LoopbackTransport, StatsCountCompletedBytes) {
  Ranks ranks(2);
  const std::vector<uint8_t> sent = Pattern(1000, 1);
  std::vector<uint8_t> received(1000);
  for (int i = 0; i < 3; ++i) {
    PostOk(ranks[1], {TransferOp::Recv(0, 1, received.data(), 1000)});
    const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 1, sent.data(), 1000)});
    ASSERT_TRUE(ranks[0].Wait(send, kWait).ok());
  }
  PostOk(ranks[0], {TransferOp::Send(1, 2, sent.data(), 1000)});  // never received
  EXPECT_EQ(ranks[0].Stats().bytes_sent, 3000u);
  EXPECT_EQ(ranks[0].Stats().bytes_received, 0u);
  EXPECT_EQ(ranks[1].Stats().bytes_received, 3000u);
  EXPECT_EQ(ranks[1].Stats().transfers_failed, 0u);
}

// Two threads drive the two ranks: 200 ping-pongs with the payload checked each time.
TEST(LoopbackTransport, TwoThreadsPingPong) {
  Ranks ranks(2);
  constexpr int kRounds = 200;
  std::string failure;
  std::thread pong([&] {
    std::vector<uint8_t> buffer(256);
    for (int i = 0; i < kRounds; ++i) {
      auto recv = ranks[1].Post({{TransferOp::Recv(0, 1, buffer.data(), buffer.size())}});
      if (!recv.ok() || !ranks[1].Wait(*recv, kWait).ok()) return;
      auto send = ranks[1].Post({{TransferOp::Send(0, 2, buffer.data(), buffer.size())}});
      if (!send.ok() || !ranks[1].Wait(*send, kWait).ok()) return;
    }
  });
  for (int i = 0; i < kRounds && failure.empty(); ++i) {
    const std::vector<uint8_t> ping = Pattern(256, static_cast<uint32_t>(i));
    std::vector<uint8_t> back(256);
    const TransferId id = PostOk(ranks[0], {TransferOp::Send(1, 1, ping.data(), 256),
                                            TransferOp::Recv(1, 2, back.data(), 256)});
    const Status status = ranks[0].Wait(id, kWait);
    if (!status.ok()) failure = status.ToString();
    if (back != ping) failure = "round " + std::to_string(i) + " came back different";
  }
  pong.join();
  EXPECT_EQ(failure, "");
}

}  // namespace
}  // namespace rubato::transport
