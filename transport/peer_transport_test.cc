// Tests for the in-process device transport's matching half (peer_transport.h) over a host fake
// of the copier, so that they run without a GPU: matching by (peer, tag) in posting order
// either way round, copies deferred until the "device" runs them (Test false until then),
// StreamWait on matched groups only, exact sizes, Cancel waiting for issued copies, closed peers,
// marks all given back, Stats, two threads. The CUDA copier is tested in
// tests/gpu/cuda_peer_transport_test.cc.
#include "transport/peer_transport.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

namespace rubato::transport {
namespace {

using std::chrono::milliseconds;

// A mark: passed, or a copy that runs when the test says (RunCopies) or someone synchronizes.
struct FakeMark {
  bool passed = true;
  void* into = nullptr;
  const void* from = nullptr;
  size_t bytes = 0;
  void Run() {
    if (!passed) std::memcpy(into, from, bytes);
    passed = true;
  }
};

// Host memory; copies wait for RunCopies() unless `eager`. Counts marks alive and stream waits.
class FakeCopier final : public PeerCopier {
 public:
  std::string_view BackendName() const override { return "fake_peer"; }
  bool SupportsMemory(MemoryKind memory) const override { return memory == MemoryKind::kHost; }
  Result<Mark> MarkPosted(int, const TransferOp&, void* stream) override {
    streams_seen.push_back(stream);
    return New(FakeMark{});
  }
  Result<Mark> Copy(int, const TransferOp& send, Mark send_posted, int, const TransferOp& recv,
                    Mark recv_posted) override {
    EXPECT_TRUE(Alive(send_posted) && Alive(recv_posted)) << "a posted mark was recycled early";
    if (fail_copies) return UnavailableError("fake copy failed");
    ++copies;
    FakeMark* mark = New(FakeMark{false, recv.data, send.data, send.bytes});
    if (eager) mark->Run();
    return static_cast<Mark>(mark);
  }
  Result<bool> Passed(Mark mark) override { return Get(mark)->passed; }
  Status StreamWait(int rank, Mark mark, void* stream) override {
    waits.push_back({rank, stream});
    EXPECT_TRUE(Alive(mark));
    return Status::Ok();
  }
  void Synchronize(Mark mark) override { Get(mark)->Run(); }
  void Recycle(Mark mark) override {
    auto* fake = Get(mark);
    EXPECT_TRUE(Alive(mark)) << "a mark was recycled twice";
    std::erase(alive_, fake);
    delete fake;
  }
  void RunCopies() {
    for (FakeMark* mark : alive_) mark->Run();
  }
  size_t MarksAlive() const { return alive_.size(); }

  bool eager = false;
  bool fail_copies = false;
  int copies = 0;
  std::vector<void*> streams_seen;
  std::vector<std::pair<int, void*>> waits;

 private:
  FakeMark* New(FakeMark mark) {
    alive_.push_back(new FakeMark(mark));
    return alive_.back();
  }
  static FakeMark* Get(Mark mark) { return static_cast<FakeMark*>(mark); }
  bool Alive(Mark mark) const {
    return std::find(alive_.begin(), alive_.end(), Get(mark)) != alive_.end();
  }
  std::vector<FakeMark*> alive_;
};

struct Ranks {
  explicit Ranks(int world) {
    auto fake = std::make_unique<FakeCopier>();
    copier = fake.get();
    auto created = PeerHub::Create(world, std::move(fake));
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    hub = std::move(created).value();
    for (int r = 0; r < world; ++r) {
      auto endpoint = hub->Endpoint(r);
      EXPECT_TRUE(endpoint.ok()) << endpoint.status().ToString();
      endpoints.push_back(std::move(endpoint).value());
    }
  }
  StreamOrderedTransport& operator[](int rank) { return *endpoints[static_cast<size_t>(rank)]; }

  FakeCopier* copier = nullptr;
  std::unique_ptr<PeerHub> hub;
  std::vector<std::unique_ptr<StreamOrderedTransport>> endpoints;
};

TransferId PostOk(Transport& t, std::vector<TransferOp> ops) {
  auto id = t.Post(ops);
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  return id.ok() ? *id : 0;
}

bool Done(Transport& t, TransferId id) {
  auto done = t.Test(id);
  EXPECT_TRUE(done.ok()) << done.status().ToString();
  return done.ok() && *done;
}

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 131 + seed * 7 + i / 251);
  return data;
}

TEST(PeerTransport, CopiesWhenBothSidesArePostedAndCompletesWhenTheCopyRuns) {
  Ranks ranks(2);
  EXPECT_EQ(ranks[0].BackendName(), "fake_peer");
  const std::vector<uint8_t> sent = Pattern(4097, 1);
  std::vector<uint8_t> received(4097, 0);
  const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 3, sent.data(), sent.size())});
  EXPECT_FALSE(Done(ranks[0], send)) << "a send with no receive completed";
  EXPECT_EQ(ranks.copier->copies, 0);
  const TransferId recv =
      PostOk(ranks[1], {TransferOp::Recv(0, 3, received.data(), received.size())});
  EXPECT_EQ(ranks.copier->copies, 1);
  EXPECT_FALSE(Done(ranks[1], recv)) << "completed before the device ran the copy";
  ranks.copier->RunCopies();
  EXPECT_TRUE(Done(ranks[1], recv));
  EXPECT_TRUE(Done(ranks[0], send));
  EXPECT_EQ(received, sent);
  EXPECT_EQ(ranks[0].Stats().bytes_sent, 4097u);
  EXPECT_EQ(ranks[1].Stats().bytes_received, 4097u);
  EXPECT_EQ(ranks.copier->MarksAlive(), 0u) << "marks not given back";
}

TEST(PeerTransport, MatchesInPostingOrderPerPeerAndTagEitherWayRound) {
  Ranks ranks(3);
  ranks.copier->eager = true;
  std::vector<std::vector<uint8_t>> sent, received;
  for (uint32_t i = 0; i < 4; ++i) sent.push_back(Pattern(64, i));
  received.assign(4, std::vector<uint8_t>(64, 0));
  // Receives first for tag 1 (two of them), sends first for tag 2; rank 2 sends on tag 1 too.
  std::vector<TransferId> recvs, sends;
  for (int i = 0; i < 2; ++i) {
    recvs.push_back(PostOk(ranks[1], {TransferOp::Recv(0, 1, received[i].data(), 64)}));
  }
  const TransferId other = PostOk(ranks[2], {TransferOp::Send(1, 1, sent[3].data(), 64)});
  EXPECT_FALSE(Done(ranks[2], other)) << "matched a receive from another peer";
  for (int i = 0; i < 2; ++i) {
    sends.push_back(PostOk(ranks[0], {TransferOp::Send(1, 1, sent[i].data(), 64)}));
  }
  sends.push_back(PostOk(ranks[0], {TransferOp::Send(1, 2, sent[2].data(), 64)}));
  recvs.push_back(PostOk(ranks[1], {TransferOp::Recv(0, 2, received[2].data(), 64)}));
  for (TransferId id : recvs) EXPECT_TRUE(Done(ranks[1], id));
  for (TransferId id : sends) EXPECT_TRUE(Done(ranks[0], id));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(received[i], sent[i]) << "message " << i;
  ranks[2].Cancel(other);
  EXPECT_EQ(ranks.copier->MarksAlive(), 0u);
}

TEST(PeerTransport, StreamWaitOrdersOnMatchedGroupsAndRefusesUnmatchedOnes) {
  Ranks ranks(2);
  std::vector<uint8_t> a = Pattern(100, 2), b(100, 0);
  void* const stream = reinterpret_cast<void*>(0x1234);
  auto recv = ranks[1].PostOnStream(std::vector{TransferOp::Recv(0, 4, b.data(), 100)}, stream);
  ASSERT_TRUE(recv.ok());
  EXPECT_EQ(ranks.copier->streams_seen.back(), stream) << "the post was not marked on its stream";
  const Status early = ranks[1].StreamWait(*recv, stream);
  EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition) << early.ToString();
  EXPECT_NE(early.message().find("op 0 (receive from peer 0, tag 4"), std::string::npos)
      << early.message();
  const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 4, a.data(), 100)});
  ASSERT_TRUE(ranks[1].StreamWait(*recv, stream).ok());
  ASSERT_EQ(ranks.copier->waits.size(), 1u);
  EXPECT_EQ(ranks.copier->waits[0], std::make_pair(1, stream));
  EXPECT_EQ(ranks[1].StreamWait(999, stream).code(), StatusCode::kInvalidArgument);
  ranks.copier->RunCopies();
  EXPECT_TRUE(Done(ranks[1], *recv));
  EXPECT_TRUE(Done(ranks[0], send));
  EXPECT_EQ(b, a);
}

TEST(PeerTransport, ASizeMismatchFailsTheReceiveNamingBothSizes) {
  Ranks ranks(2);
  std::vector<uint8_t> a(10, 1), b(12, 0);
  const TransferId recv = PostOk(ranks[1], {TransferOp::Recv(0, 5, b.data(), 12)});
  const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 5, a.data(), 10)});
  auto failed = ranks[1].Test(recv);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(failed.status().message().find("10 bytes but the receive buffer has 12"),
            std::string::npos)
      << failed.status().message();
  EXPECT_TRUE(Done(ranks[0], send)) << "the sender cannot know the receiver's size";
  EXPECT_EQ(b, std::vector<uint8_t>(12, 0));
  EXPECT_EQ(ranks[1].Stats().transfers_failed, 1u);
  EXPECT_EQ(ranks.copier->copies, 0);
}

TEST(PeerTransport, CancelWaitsForAnIssuedCopyAndUnqueuesTheRest) {
  Ranks ranks(2);
  std::vector<uint8_t> a = Pattern(256, 3), b(256, 0), c(256, 0);
  const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 6, a.data(), 256)});
  // One group: a receive that matches at once and one nobody sends to.
  const TransferId group = PostOk(
      ranks[1], {TransferOp::Recv(0, 6, b.data(), 256), TransferOp::Recv(0, 7, c.data(), 256)});
  EXPECT_FALSE(Done(ranks[1], group));
  ranks[1].Cancel(group);
  EXPECT_EQ(b, a) << "Cancel returned before the issued copy finished";
  EXPECT_FALSE(ranks[1].Test(group).ok()) << "a cancelled id is unknown";
  // The cancelled tag-7 receive is gone: a later send on tag 7 waits for a new receive.
  const TransferId late = PostOk(ranks[0], {TransferOp::Send(1, 7, a.data(), 256)});
  EXPECT_FALSE(Done(ranks[0], late));
  const TransferId again = PostOk(ranks[1], {TransferOp::Recv(0, 7, c.data(), 256)});
  ranks.copier->RunCopies();
  EXPECT_TRUE(Done(ranks[1], again));
  EXPECT_TRUE(Done(ranks[0], late));
  EXPECT_TRUE(Done(ranks[0], send));
  EXPECT_EQ(c, a);
  EXPECT_EQ(ranks.copier->MarksAlive(), 0u);
}

TEST(PeerTransport, AClosedPeerFailsPendingOpsAndLaterPosts) {
  Ranks ranks(2);
  std::vector<uint8_t> b(8, 0);
  const TransferId recv = PostOk(ranks[1], {TransferOp::Recv(0, 1, b.data(), 8)});
  ranks.endpoints[0].reset();
  auto failed = ranks[1].Test(recv);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(failed.status().message().find("closed its endpoint"), std::string::npos);
  auto refused = ranks[1].Post(std::vector{TransferOp::Recv(0, 1, b.data(), 8)});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(ranks.copier->MarksAlive(), 0u);
  EXPECT_EQ(ranks.hub->Endpoint(1).status().code(), StatusCode::kFailedPrecondition);
}

TEST(PeerTransport, RefusesInvalidOpsAndAFailedCopyFailsBothSides) {
  Ranks ranks(2);
  std::vector<uint8_t> a(8, 1), b(8, 0);
  auto to_self = ranks[0].Post(std::vector{TransferOp::Send(0, 1, a.data(), 8)});
  EXPECT_EQ(to_self.status().code(), StatusCode::kInvalidArgument);
  auto device = ranks[0].Post(std::vector{TransferOp::Send(1, 1, a.data(), 8, MemoryKind::kCuda)});
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument) << "the fake is host-only";
  EXPECT_FALSE(PeerHub::Create(0, std::make_unique<FakeCopier>()).ok());
  ranks.copier->fail_copies = true;
  const TransferId send = PostOk(ranks[0], {TransferOp::Send(1, 2, a.data(), 8)});
  const TransferId recv = PostOk(ranks[1], {TransferOp::Recv(0, 2, b.data(), 8)});
  EXPECT_EQ(ranks[0].Test(send).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(ranks[1].Test(recv).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(ranks.copier->MarksAlive(), 0u);
}

TEST(PeerTransport, TwoThreadsPingPongThroughWait) {
  Ranks ranks(2);
  ranks.copier->eager = true;  // copies happen under the hub's mutex, on the posting thread
  constexpr int kRounds = 200;
  std::thread echo([&] {
    std::vector<uint8_t> buffer(512);
    for (int i = 0; i < kRounds; ++i) {
      const TransferId in = PostOk(ranks[1], {TransferOp::Recv(0, 1, buffer.data(), 512)});
      ASSERT_TRUE(ranks[1].Wait(in, milliseconds(20000)).ok());
      const TransferId out = PostOk(ranks[1], {TransferOp::Send(0, 2, buffer.data(), 512)});
      ASSERT_TRUE(ranks[1].Wait(out, milliseconds(20000)).ok());
    }
  });
  for (int i = 0; i < kRounds; ++i) {
    const std::vector<uint8_t> out = Pattern(512, static_cast<uint32_t>(i));
    std::vector<uint8_t> back(512, 0);
    const TransferId id = PostOk(ranks[0], {TransferOp::Send(1, 1, out.data(), 512),
                                            TransferOp::Recv(1, 2, back.data(), 512)});
    ASSERT_TRUE(ranks[0].Wait(id, milliseconds(20000)).ok());
    ASSERT_EQ(back, out) << "round " << i;
  }
  echo.join();
  EXPECT_EQ(ranks[0].Stats().bytes_sent, 512u * kRounds);
}

}  // namespace
}  // namespace rubato::transport
