// The cache service's data plane against a peer that does not take its replies at once (a UCX
// peer whose worker is busy elsewhere, such as in a control-plane call to this cache rank): the
// next pack waits for the previous reply's send across sweeps, never with the service's mutex
// held, so control-plane calls are served meanwhile; once the peer receives, the waiting pack is
// processed and answered. Over the loopback transport, whose sends complete only when their
// receive is posted. And a peer that speaks another layer-pack version is refused by name.
#include "cache_rank/cache_service.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "transport/layer_pack.h"
#include "transport/loopback_transport.h"
#include "transport/pack_protocol.h"

namespace rubato {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;
using transport::TransferOp;

constexpr uint32_t kHeads = 2;
constexpr uint32_t kHeadDim = 8;

SessionShape Shape() {
  SessionShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = kHeads;
  shape.num_query_heads = kHeads;
  shape.head_dim = kHeadDim;
  shape.capacity_tokens = 16;
  return shape;
}

// Waits up to 60 s (a busy CI machine) for `done`.
template <typename Done>
bool WaitFor(const Done& done) {
  const auto deadline = steady_clock::now() + std::chrono::seconds(60);
  while (!done()) {
    if (steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(2));
  }
  return true;
}

TEST(CacheServiceDataPlane, ControlCallsAreServedWhileAReplyWaitsForItsReceiver) {
  auto hub = transport::LoopbackHub::Create(2);
  ASSERT_TRUE(hub.ok()) << hub.status().ToString();
  auto service_end = (*hub)->Endpoint(0);
  auto client = (*hub)->Endpoint(1);
  ASSERT_TRUE(service_end.ok() && client.ok());
  CacheService service(CacheServiceOptions{});
  ASSERT_TRUE(service.AddPeer(/*peer=*/1, std::move(*service_end), /*peer_rank=*/1).ok());
  service.Start();
  const Result<uint64_t> session = service.OpenSession(1, 7, Shape(), {});
  ASSERT_TRUE(session.ok()) << session.status().ToString();

  // Two one-token packs of the session, sent back to back; no receive for their replies yet.
  std::vector<std::vector<std::byte>> packs;
  std::vector<transport::TransferId> sends;
  std::vector<uint64_t> reply_bytes;
  for (uint32_t position = 0; position < 2; ++position) {
    LayerPackShape shape;
    shape.step = position;
    shape.num_kv_heads = shape.num_query_heads = kHeads;
    shape.head_dim = kHeadDim;
    shape.has_query = true;  // the attention selector's: the reply is the query's attention
    const LayerPackRequest request{*session, position, 1, 0, 1};
    auto layout = LayerPackLayout::Compute(shape, {&request, 1});
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    packs.emplace_back(layout->total_bytes(), std::byte{0});
    ASSERT_TRUE(LayerPackWriter::Create(shape, {&request, 1}, packs.back()).ok());
    LayerPackShape reply = shape;
    reply.kind = LayerPackKind::kReplyPack;
    auto reply_layout = LayerPackLayout::Compute(reply, {&request, 1});
    ASSERT_TRUE(reply_layout.ok()) << reply_layout.status().ToString();
    reply_bytes.push_back(reply_layout->total_bytes());
    const TransferOp ops[] = {
        TransferOp::Send(0, kPackHeaderTag, packs.back().data(), sizeof(LayerPackHeader)),
        TransferOp::Send(0, kPackTag, packs.back().data(), packs.back().size())};
    auto sent = (*client)->Post(ops);
    ASSERT_TRUE(sent.ok()) << sent.status().ToString();
    sends.push_back(*sent);
  }
  ASSERT_TRUE(WaitFor([&] { return service.Stats().packs_received == 2; }))
      << "packs received: " << service.Stats().packs_received;

  // The second pack waits for the first reply's send. Control calls still pass: before, the
  // data plane held the mutex in a blocking wait of up to 60 s for the peer to receive.
  const auto began = steady_clock::now();
  const Result<uint64_t> other = service.OpenSession(1, 8, Shape(), {});
  const CacheServiceStats stats = service.Stats();
  const auto took = steady_clock::now() - began;
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  EXPECT_LT(took, std::chrono::seconds(10)) << "a control call waited behind the data plane";
  EXPECT_EQ(stats.replies_sent, 0u);
  EXPECT_TRUE(service.PeerHealth(1).ok());

  // The peer receives: both replies arrive, in order, and the peer stays healthy.
  std::vector<std::vector<std::byte>> replies;
  for (const uint64_t bytes : reply_bytes) {
    replies.emplace_back(bytes);
    const TransferOp receive =
        TransferOp::Recv(0, kReplyTag, replies.back().data(), replies.back().size());
    auto posted = (*client)->Post({&receive, 1});
    ASSERT_TRUE(posted.ok()) << posted.status().ToString();
    ASSERT_TRUE((*client)->Wait(*posted, milliseconds(60000)).ok());
  }
  for (const auto id : sends) ASSERT_TRUE((*client)->Wait(id, milliseconds(60000)).ok());
  for (size_t i = 0; i < replies.size(); ++i) {
    auto view = LayerPackView::Parse(replies[i]);
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_EQ(view->kind(), LayerPackKind::kReplyPack);
    EXPECT_EQ(view->step(), i);
  }
  EXPECT_TRUE(WaitFor([&] { return service.Stats().replies_sent == 2; }));
  EXPECT_TRUE(service.PeerHealth(1).ok());
  service.Stop();
}

TEST(CacheServiceDataPlane, APeerOfAnotherPackVersionIsRefusedByName) {
  auto hub = transport::LoopbackHub::Create(2);
  ASSERT_TRUE(hub.ok()) << hub.status().ToString();
  auto service_end = (*hub)->Endpoint(0);
  auto client = (*hub)->Endpoint(1);
  ASSERT_TRUE(service_end.ok() && client.ok());
  CacheService service(CacheServiceOptions{});
  ASSERT_TRUE(service.AddPeer(/*peer=*/1, std::move(*service_end), /*peer_rank=*/1).ok());
  service.Start();
  const Result<uint64_t> session = service.OpenSession(1, 7, Shape(), {});
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  LayerPackShape shape;
  shape.num_kv_heads = shape.num_query_heads = kHeads;
  shape.head_dim = kHeadDim;
  shape.has_query = true;
  const LayerPackRequest request{*session, 0, 1, 0, 1};
  std::vector<std::byte> pack(*KvPackBytes(shape, {&request, 1}));
  ASSERT_TRUE(LayerPackWriter::Create(shape, {&request, 1}, pack).ok());
  const uint16_t version = 2;  // a build from before delta replies
  std::memcpy(pack.data() + offsetof(LayerPackHeader, version), &version, sizeof(version));
  const TransferOp header =
      TransferOp::Send(0, kPackHeaderTag, pack.data(), sizeof(LayerPackHeader));
  ASSERT_TRUE((*client)->Post({&header, 1}).ok());
  ASSERT_TRUE(WaitFor([&] { return !service.PeerHealth(1).ok(); }));
  const Status health = service.PeerHealth(1);
  EXPECT_EQ(health.code(), StatusCode::kUnsupported) << health.ToString();
  EXPECT_NE(health.message().find("a KV pack of layer-pack version 2, this cache rank reads "
                                  "version 3"),
            std::string::npos)
      << health.ToString();
  EXPECT_EQ(service.Stats().packs_received, 0u);
  service.Stop();
}

// Delta replies need a selector that replies rows: a delta KV pack of an attention session stops
// the peer's data plane naming the selector.
TEST(CacheServiceDataPlane, ADeltaPackOfAnAttentionSessionIsRefusedByName) {
  auto hub = transport::LoopbackHub::Create(2);
  ASSERT_TRUE(hub.ok()) << hub.status().ToString();
  auto service_end = (*hub)->Endpoint(0);
  auto client = (*hub)->Endpoint(1);
  ASSERT_TRUE(service_end.ok() && client.ok());
  CacheService service(CacheServiceOptions{});
  ASSERT_TRUE(service.AddPeer(/*peer=*/1, std::move(*service_end), /*peer_rank=*/1).ok());
  service.Start();
  const Result<uint64_t> session = service.OpenSession(1, 7, Shape(), {});
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  LayerPackShape shape;
  shape.num_kv_heads = shape.num_query_heads = kHeads;
  shape.head_dim = kHeadDim;
  shape.has_query = true;
  shape.delta = true;
  const LayerPackRequest request{*session, 0, 1, 0, 1};
  std::vector<std::byte> pack(*KvPackBytes(shape, {&request, 1}));
  ASSERT_TRUE(LayerPackWriter::Create(shape, {&request, 1}, pack).ok());
  const TransferOp sends[] = {
      TransferOp::Send(0, kPackHeaderTag, pack.data(), sizeof(LayerPackHeader)),
      TransferOp::Send(0, kPackTag, pack.data(), pack.size())};
  ASSERT_TRUE((*client)->Post(sends).ok());
  ASSERT_TRUE(WaitFor([&] { return !service.PeerHealth(1).ok(); }));
  const Status health = service.PeerHealth(1);
  EXPECT_NE(health.message().find("asks for delta replies, its attention selector replies no "
                                  "rows"),
            std::string::npos)
      << health.ToString();
  service.Stop();
}

}  // namespace
}  // namespace rubato
