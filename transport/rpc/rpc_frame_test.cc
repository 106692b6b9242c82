// Tests of the RPC frame format (rpc_frame.h): encode/decode round trips split at every read
// boundary, and every kind of bad input (bad magic, oversized length without allocating it,
// truncated and garbage payloads), plus the Error <-> Status mapping.
//
// This binary replaces the global operator new/delete (below) with malloc/free. GCC 12 then
// reports -Wmismatched-new-delete at every inlined std::allocator use, a false positive: the
// replacement pair is consistent. The pragma precedes every include because the warning is
// reported at header locations.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include "transport/rpc/rpc_frame.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

// The largest single operator-new request since the last reset: shows that the decoder does not
// allocate what a hostile length field announces. Replaces the global operator new/delete of
// this test binary (malloc/free underneath, which AddressSanitizer still checks).
namespace {
std::atomic<size_t> g_largest_allocation{0};
}  // namespace

void* operator new(size_t size) {
  size_t seen = g_largest_allocation.load();
  while (size > seen && !g_largest_allocation.compare_exchange_weak(seen, size)) {
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace rubato::rpc {
namespace {

Envelope SampleEnvelope(uint64_t call_id) {
  Envelope envelope;
  envelope.set_call_id(call_id);
  HelloRequest* hello = envelope.mutable_hello_request();
  hello->set_protocol_version(kProtocolVersion);
  hello->set_role(ROLE_INFERENCE);
  hello->set_rank(3);
  hello->mutable_model_shape()->set_num_layers(36);
  hello->mutable_model_shape()->set_num_kv_heads(8);
  hello->mutable_model_shape()->set_num_query_heads(32);
  hello->mutable_model_shape()->set_head_dim(128);
  hello->mutable_model_shape()->set_kv_dtype("bf16");
  hello->set_transport_backend("ucx");
  hello->set_transport_address(std::string("\x00\x01\xff\x7f", 4) + std::string(300, 'a'));
  return envelope;
}

std::string Frame(const Envelope& envelope) {
  Result<std::string> frame = EncodeFrame(envelope);
  EXPECT_TRUE(frame.ok()) << frame.status().ToString();
  return frame.ok() ? *frame : std::string();
}

std::string Header(const char magic[4], uint32_t length) {
  std::string header(magic, 4);
  for (int i = 0; i < 4; ++i) header += static_cast<char>((length >> (8 * i)) & 0xff);
  return header;
}

TEST(RpcFrameTest, HeaderIsMagicThenLittleEndianLength) {
  const Envelope envelope = SampleEnvelope(7);
  const std::string frame = Frame(envelope);
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + envelope.ByteSizeLong());
  EXPECT_EQ(frame.substr(0, 4), "RBRP");
  EXPECT_EQ(frame.substr(0, 8), Header("RBRP", static_cast<uint32_t>(envelope.ByteSizeLong())));
}

TEST(RpcFrameTest, RoundTripsSplitAtEveryBoundary) {
  // Three frames back to back (one with an empty body, i.e. a zero-length payload is legal).
  const std::vector<Envelope> sent = {SampleEnvelope(1), Envelope(), SampleEnvelope(3)};
  std::string stream;
  for (const Envelope& e : sent) stream += Frame(e);
  // Every split point in two pieces, then pieces of every size from 1 to 17 bytes.
  std::vector<std::vector<size_t>> splittings;
  for (size_t cut = 0; cut <= stream.size(); ++cut) splittings.push_back({cut, stream.size()});
  for (size_t piece = 1; piece <= 17; ++piece) {
    std::vector<size_t> cuts;
    for (size_t at = piece; at < stream.size(); at += piece) cuts.push_back(at);
    cuts.push_back(stream.size());
    splittings.push_back(cuts);
  }
  for (const std::vector<size_t>& cuts : splittings) {
    FrameDecoder decoder;
    std::vector<Envelope> received;
    size_t begin = 0;
    for (size_t end : cuts) {
      ASSERT_TRUE(decoder.Feed(std::string_view(stream).substr(begin, end - begin), &received).ok());
      begin = end;
    }
    ASSERT_EQ(received.size(), sent.size()) << "first cut " << cuts.front();
    for (size_t i = 0; i < sent.size(); ++i) {
      EXPECT_EQ(received[i].SerializeAsString(), sent[i].SerializeAsString()) << "frame " << i;
    }
    EXPECT_EQ(decoder.buffered_bytes(), 0u);
  }
  FrameDecoder decoder;
  std::vector<Envelope> received;
  ASSERT_TRUE(decoder.Feed(stream, &received).ok());
  EXPECT_EQ(received.at(0).hello_request().transport_address(),
            sent[0].hello_request().transport_address());
  EXPECT_EQ(received.at(2).call_id(), 3u);
}

TEST(RpcFrameTest, BadMagicIsReportedAsSoonAsItsBytesArrive) {
  FrameDecoder decoder;
  std::vector<Envelope> received;
  const Status status = decoder.Feed("GE", &received);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_NE(status.message().find("bad magic 'GE'"), std::string::npos) << status.message();
  EXPECT_TRUE(decoder.failed());
  // Sticky: a valid frame afterwards does not resynchronise the stream.
  EXPECT_FALSE(decoder.Feed(Frame(SampleEnvelope(1)), &received).ok());
  EXPECT_TRUE(received.empty());
}

TEST(RpcFrameTest, BinaryBadMagicIsShownInHex) {
  FrameDecoder decoder;
  std::vector<Envelope> received;
  const Status status = decoder.Feed(std::string("RB\x00\xff", 4), &received);
  EXPECT_NE(status.message().find("0x52 0x42 0x00 0xff"), std::string::npos) << status.message();
}

TEST(RpcFrameTest, OversizedLengthIsRefusedBeforeAllocating) {
  FrameDecoder decoder(1024);
  std::vector<Envelope> received;
  g_largest_allocation = 0;
  const Status status = decoder.Feed(Header("RBRP", 0xffffffffu), &received);
  const size_t largest = g_largest_allocation.load();
  EXPECT_EQ(status.code(), StatusCode::kOutOfRange);
  EXPECT_NE(status.message().find("4294967295"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("1024"), std::string::npos) << status.message();
  EXPECT_LT(largest, 64u * 1024) << "the decoder allocated " << largest << " bytes";
  EXPECT_LE(decoder.buffered_bytes(), kFrameHeaderBytes);

  // A length just above the limit is refused, at the limit accepted (then awaits its payload).
  FrameDecoder at_limit(1024);
  EXPECT_EQ(at_limit.Feed(Header("RBRP", 1025), &received).code(), StatusCode::kOutOfRange);
  FrameDecoder below(1024);
  EXPECT_TRUE(below.Feed(Header("RBRP", 1024), &received).ok());
  EXPECT_TRUE(received.empty());
}

// A header announcing the largest allowed frame (16 MiB) holds no more memory than the bytes that
// came: eight bytes from an unauthenticated peer must not reserve 16 MiB per connection.
TEST(RpcFrameTest, AnnouncedLengthIsNotReservedUpFront) {
  FrameDecoder decoder;
  std::vector<Envelope> received;
  g_largest_allocation = 0;
  ASSERT_TRUE(decoder.Feed(Header("RBRP", kDefaultMaxFrameBytes), &received).ok());
  ASSERT_TRUE(decoder.Feed(std::string(1000, 'x'), &received).ok());
  const size_t largest = g_largest_allocation.load();
  EXPECT_LE(largest, 64u * 1024 + 64) << "the decoder allocated " << largest << " bytes";
  EXPECT_EQ(decoder.buffered_bytes(), kFrameHeaderBytes + 1000);
  EXPECT_TRUE(received.empty());
}

TEST(RpcFrameTest, TruncatedFrameYieldsNothingAndWaits) {
  const std::string frame = Frame(SampleEnvelope(9));
  FrameDecoder decoder;
  std::vector<Envelope> received;
  ASSERT_TRUE(decoder.Feed(std::string_view(frame).substr(0, frame.size() - 1), &received).ok());
  EXPECT_TRUE(received.empty());
  EXPECT_EQ(decoder.buffered_bytes(), frame.size() - 1);
  ASSERT_TRUE(decoder.Feed(std::string_view(frame).substr(frame.size() - 1), &received).ok());
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].call_id(), 9u);
}

TEST(RpcFrameTest, GarbagePayloadIsRefused) {
  // 0xff... is an invalid tag/varint sequence for any message.
  const std::string garbage(16, '\xff');
  FrameDecoder decoder;
  std::vector<Envelope> received;
  const Status status = decoder.Feed(Header("RBRP", 16) + garbage, &received);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_NE(status.message().find("16 bytes does not parse"), std::string::npos)
      << status.message();
  EXPECT_TRUE(received.empty());
}

TEST(RpcFrameTest, TruncatedPayloadInsideAFrameIsRefused) {
  // A frame whose length covers only half of a serialized Envelope: the payload is cut in the
  // middle of a field.
  const std::string payload = SampleEnvelope(5).SerializeAsString();
  const uint32_t half = static_cast<uint32_t>(payload.size() / 2);
  FrameDecoder decoder;
  std::vector<Envelope> received;
  const Status status = decoder.Feed(Header("RBRP", half) + payload.substr(0, half), &received);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.ToString();
  EXPECT_TRUE(received.empty());
}

TEST(RpcFrameTest, FramesBeforeAnErrorAreStillDelivered) {
  FrameDecoder decoder;
  std::vector<Envelope> received;
  const Status status = decoder.Feed(Frame(SampleEnvelope(4)) + "XXXX", &received);
  EXPECT_FALSE(status.ok());
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(received[0].call_id(), 4u);
}

TEST(RpcFrameTest, EncodeRefusesAPayloadAboveTheMaximum) {
  const Result<std::string> frame = EncodeFrame(SampleEnvelope(1), 64);
  ASSERT_FALSE(frame.ok());
  EXPECT_EQ(frame.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(frame.status().message().find("hello_request"), std::string::npos);
}

TEST(RpcFrameTest, ErrorStatusMappingKeepsCodeAndMessage) {
  for (int code = 1; code <= static_cast<int>(StatusCode::kInternal); ++code) {
    const Status status(static_cast<StatusCode>(code), "message " + std::to_string(code));
    const Status back = StatusFromError(ErrorFromStatus(status));
    EXPECT_EQ(back.code(), status.code());
    EXPECT_EQ(back.message(), status.message());
  }
  EXPECT_EQ(ErrorCode_Name(ErrorFromStatus(DeadlineExceededError("x")).code()),
            "DEADLINE_EXCEEDED");
  Error unknown;
  unknown.set_code(static_cast<ErrorCode>(99));
  unknown.set_message("odd");
  EXPECT_EQ(StatusFromError(unknown).code(), StatusCode::kInternal);
  Error unspecified;
  EXPECT_EQ(StatusFromError(unspecified).code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace rubato::rpc
