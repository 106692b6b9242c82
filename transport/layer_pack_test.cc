// Tests for the layer-pack wire format: round trips of every header field, table entry and
// section for KV and reply packs over several shapes; sizes by hand and by helper; every kind
// of corruption refused with an error naming the field; truncation at every length; checks
// against a session field by field; reply content validation; the attention sections of a
// reply; a peer of another format version refused by name.
#include "transport/layer_pack.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace rubato {
namespace {

using Bytes = std::vector<std::byte>;

// A byte that depends on where it is written, so misplaced or swapped sections show up.
std::byte PatternByte(uint32_t layer, uint32_t request, int section, size_t index) {
  return static_cast<std::byte>((layer * 131u + request * 71u + section * 29u + index * 7u +
                                 1u) & 0xffu);
}

void FillPattern(std::span<std::byte> span, uint32_t layer, uint32_t request, int section) {
  for (size_t i = 0; i < span.size(); ++i) span[i] = PatternByte(layer, request, section, i);
}

::testing::AssertionResult HasPattern(std::span<const std::byte> span, uint32_t layer,
                                      uint32_t request, int section) {
  for (size_t i = 0; i < span.size(); ++i) {
    if (span[i] != PatternByte(layer, request, section, i)) {
      return ::testing::AssertionFailure() << "layer " << layer << " request " << request
                                           << " section " << section << " byte " << i;
    }
  }
  return ::testing::AssertionSuccess();
}

// With `attention`, even requests ask for the attention of their query (odd ones do not).
std::vector<LayerPackRequest> MakeRequests(uint32_t batch, uint32_t new_tokens_base,
                                           bool attention) {
  std::vector<LayerPackRequest> requests;
  for (uint32_t r = 0; r < batch; ++r) {
    // Different sessions, positions and chunk lengths per request.
    const uint32_t new_tokens = new_tokens_base == 1 ? 1 : new_tokens_base + r;
    const uint32_t first = 100 + 17 * r;
    requests.push_back({1000 + 3 * r, first, new_tokens, 1 + (first + new_tokens) / 3,
                        attention && r % 2 == 0 ? 1u : 0u});
  }
  return requests;
}

LayerPackShape MakeShape(LayerPackKind kind, uint32_t layers, DType dtype, bool has_query) {
  LayerPackShape shape;
  shape.kind = kind;
  shape.step = 0x1234567890ull;
  shape.first_layer = 6;
  shape.num_layers = layers;
  shape.dtype = dtype;
  shape.num_kv_heads = 2;
  shape.num_query_heads = 6;
  shape.head_dim = 5;  // odd, so bf16/f16 sections need padding
  shape.has_query = has_query;
  return shape;
}

// P, B, dtype, has_query, new_tokens base (1: decode; 7: prefill chunks 7, 8, ...).
using RoundTripParam = std::tuple<uint32_t, uint32_t, DType, bool, uint32_t>;

class LayerPackRoundTrip : public ::testing::TestWithParam<RoundTripParam> {};

TEST_P(LayerPackRoundTrip, KvPackEveryFieldAndSection) {
  const auto [layers, batch, dtype, has_query, new_tokens] = GetParam();
  const LayerPackShape shape = MakeShape(LayerPackKind::kKvPack, layers, dtype, has_query);
  const auto requests = MakeRequests(batch, new_tokens, /*attention=*/has_query);
  auto size = KvPackBytes(shape, requests);
  ASSERT_TRUE(size.ok()) << size.status().ToString();
  Bytes buffer(*size + 40, std::byte{0xee});  // larger than needed: the writer uses a prefix
  auto writer = LayerPackWriter::Create(shape, requests, buffer);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_EQ(writer->size_bytes(), *size);
  const size_t elem = DTypeSize(dtype);
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t r = 0; r < batch; ++r) {
      const size_t kv_bytes = size_t{shape.num_kv_heads} * requests[r].new_tokens *
                              shape.head_dim * elem;
      ASSERT_EQ(writer->Key(l, r).size(), kv_bytes);
      ASSERT_EQ(writer->Value(l, r).size(), kv_bytes);
      ASSERT_EQ(writer->Query(l, r).size(),
                has_query ? size_t{shape.num_query_heads} * shape.head_dim * elem : 0u);
      EXPECT_TRUE(writer->Counts(l, r).empty());
      EXPECT_TRUE(writer->Positions(l, r).empty());
      EXPECT_TRUE(writer->AttentionOutput(l, r).empty());
      EXPECT_TRUE(writer->AttentionLse(l, r).empty());
      for (auto span : {writer->Key(l, r), writer->Value(l, r), writer->Query(l, r)}) {
        if (!span.empty()) {
          EXPECT_EQ((span.data() - buffer.data()) % kLayerPackSectionAlignment, 0);
        }
      }
      FillPattern(writer->Key(l, r), l, r, 0);
      FillPattern(writer->Value(l, r), l, r, 1);
      FillPattern(writer->Query(l, r), l, r, 2);
    }
  }
  const std::span<const std::byte> message(buffer.data(), *size);
  auto view = LayerPackView::Parse(message);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(view->kind(), LayerPackKind::kKvPack);
  EXPECT_EQ(view->step(), shape.step);
  EXPECT_EQ(view->first_layer(), shape.first_layer);
  EXPECT_EQ(view->num_layers(), layers);
  EXPECT_EQ(view->batch(), batch);
  EXPECT_EQ(view->dtype(), dtype);
  EXPECT_EQ(view->num_kv_heads(), shape.num_kv_heads);
  EXPECT_EQ(view->num_query_heads(), shape.num_query_heads);
  EXPECT_EQ(view->head_dim(), shape.head_dim);
  EXPECT_EQ(view->has_query(), has_query);
  ASSERT_EQ(view->requests().size(), requests.size());
  for (uint32_t r = 0; r < batch; ++r) EXPECT_EQ(view->requests()[r], requests[r]) << r;
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t r = 0; r < batch; ++r) {
      // Same place as the writer's span, same bytes.
      EXPECT_EQ(view->Key(l, r).data(), writer->Key(l, r).data());
      EXPECT_EQ(view->Key(l, r).size(), writer->Key(l, r).size());
      EXPECT_EQ(view->Value(l, r).size(), writer->Value(l, r).size());
      EXPECT_EQ(view->Query(l, r).size(), writer->Query(l, r).size());
      EXPECT_TRUE(HasPattern(view->Key(l, r), l, r, 0));
      EXPECT_TRUE(HasPattern(view->Value(l, r), l, r, 1));
      EXPECT_TRUE(HasPattern(view->Query(l, r), l, r, 2));
    }
  }
  EXPECT_TRUE(view->Key(layers, 0).empty());
  EXPECT_TRUE(view->Key(0, batch).empty());
}

TEST_P(LayerPackRoundTrip, ReplyPackEveryFieldAndSection) {
  const auto [layers, batch, dtype, has_query, new_tokens] = GetParam();
  // has_query is ignored for replies: they never carry a query.
  const LayerPackShape shape = MakeShape(LayerPackKind::kReplyPack, layers, dtype, has_query);
  const auto requests = MakeRequests(batch, new_tokens, /*attention=*/true);
  auto size = ReplyPackBytes(shape, requests);
  ASSERT_TRUE(size.ok()) << size.status().ToString();
  Bytes buffer(*size);
  auto writer = LayerPackWriter::Create(shape, requests, buffer);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_EQ(writer->size_bytes(), *size);
  const size_t elem = DTypeSize(dtype);
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t r = 0; r < batch; ++r) {
      const size_t slots = size_t{shape.num_kv_heads} * requests[r].reply_slots;
      ASSERT_EQ(writer->Counts(l, r).size(), shape.num_kv_heads * 4u);
      ASSERT_EQ(writer->Positions(l, r).size(), slots * 4);
      ASSERT_EQ(writer->Key(l, r).size(), slots * shape.head_dim * elem);
      ASSERT_EQ(writer->Value(l, r).size(), slots * shape.head_dim * elem);
      EXPECT_TRUE(writer->Query(l, r).empty());
      // The attention sections are f32 whatever the dtype, one query row when asked for.
      const size_t heads = size_t{requests[r].attention_queries} * shape.num_query_heads;
      ASSERT_EQ(writer->AttentionOutput(l, r).size(), heads * shape.head_dim * 4);
      ASSERT_EQ(writer->AttentionLse(l, r).size(), heads * 4);
      for (auto span : {writer->AttentionOutput(l, r), writer->AttentionLse(l, r)}) {
        if (!span.empty()) {
          EXPECT_EQ((span.data() - buffer.data()) % kLayerPackSectionAlignment, 0);
        }
      }
      FillPattern(writer->Counts(l, r), l, r, 3);
      FillPattern(writer->Positions(l, r), l, r, 4);
      FillPattern(writer->Key(l, r), l, r, 0);
      FillPattern(writer->Value(l, r), l, r, 1);
      FillPattern(writer->AttentionOutput(l, r), l, r, 5);
      FillPattern(writer->AttentionLse(l, r), l, r, 6);
    }
  }
  auto view = LayerPackView::Parse(buffer);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_EQ(view->kind(), LayerPackKind::kReplyPack);
  EXPECT_FALSE(view->has_query());
  EXPECT_EQ(view->step(), shape.step);
  EXPECT_EQ(view->num_layers(), layers);
  for (uint32_t r = 0; r < batch; ++r) EXPECT_EQ(view->requests()[r], requests[r]) << r;
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t r = 0; r < batch; ++r) {
      EXPECT_EQ(view->Counts(l, r).data(), writer->Counts(l, r).data());
      EXPECT_TRUE(HasPattern(view->Counts(l, r), l, r, 3));
      EXPECT_TRUE(HasPattern(view->Positions(l, r), l, r, 4));
      EXPECT_TRUE(HasPattern(view->Key(l, r), l, r, 0));
      EXPECT_TRUE(HasPattern(view->Value(l, r), l, r, 1));
      EXPECT_EQ(view->AttentionOutput(l, r).size(), writer->AttentionOutput(l, r).size());
      EXPECT_TRUE(HasPattern(view->AttentionOutput(l, r), l, r, 5));
      EXPECT_TRUE(HasPattern(view->AttentionLse(l, r), l, r, 6));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerPackRoundTrip,
                         ::testing::Combine(::testing::Values(1u, 3u), ::testing::Values(1u, 4u),
                                            ::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16),
                                            ::testing::Bool(), ::testing::Values(1u, 7u)));

TEST(LayerPackSizes, MatchHandComputedLayout) {
  // f32, 2 KV heads, 4 query heads, head_dim 4, 1 new token, query on, P = 2, B = 1:
  // header 64 + table 32 = 96; per layer K 2*1*4*4 = 32, V 32, Q 4*4*4 = 64.
  LayerPackShape shape;
  shape.num_layers = 2;
  shape.num_kv_heads = 2;
  shape.num_query_heads = 4;
  shape.head_dim = 4;
  shape.has_query = true;
  const std::vector<LayerPackRequest> one = {{7, 10, 1, 5}};
  EXPECT_EQ(*KvPackBytes(shape, one), 96u + 2 * 128u);
  // Reply: counts 2*4 = 8 -> 16, positions 2*5*4 = 40 -> 48, K 2*5*4*4 = 160, V 160.
  EXPECT_EQ(*ReplyPackBytes(shape, one), 96u + 2 * (16u + 48u + 160u + 160u));
  // bf16, head_dim 3, one KV head: K is 6 bytes, padded to 16; B = 3 puts the payload at
  // align16(64 + 96) = 160.
  shape.dtype = DType::kBF16;
  shape.head_dim = 3;
  shape.num_kv_heads = 1;
  shape.num_query_heads = 1;
  shape.has_query = false;
  shape.num_layers = 1;
  const std::vector<LayerPackRequest> three = {{1, 0, 1, 1}, {2, 0, 1, 1}, {3, 0, 1, 1}};
  EXPECT_EQ(*KvPackBytes(shape, three), 160u + 3 * (16u + 16u));
  // An attention reply (no rows): counts 4 -> 16, output 1 head x 3 x 4 = 12 -> 16, lse 4 -> 16,
  // the same at every context length.
  for (const uint32_t first : {0u, 5000u}) {
    const std::vector<LayerPackRequest> attention = {{1, first, 1, 0, 1}};
    EXPECT_EQ(*ReplyPackBytes(shape, attention), 96u + 16u + 16u + 16u) << first;
  }
}

TEST(LayerPackLayout, RefusesAttentionWithoutAQueryOrOfSeveralQueries) {
  LayerPackShape shape;
  shape.num_kv_heads = 1;
  shape.num_query_heads = 2;
  shape.head_dim = 4;
  const std::vector<LayerPackRequest> asks = {{1, 3, 1, 0, 1}};
  const auto no_query = KvPackBytes(shape, asks);
  ASSERT_FALSE(no_query.ok());
  EXPECT_NE(no_query.status().message().find("'attention_queries' is 1 but the kv pack carries "
                                              "no query"),
            std::string::npos)
      << no_query.status().ToString();
  shape.has_query = true;
  EXPECT_TRUE(KvPackBytes(shape, asks).ok());
  const std::vector<LayerPackRequest> two = {{1, 3, 2, 0, 2}};
  const auto several = KvPackBytes(shape, two);
  ASSERT_FALSE(several.ok());
  EXPECT_NE(several.status().message().find("'attention_queries' is 2, must be 0 or 1"),
            std::string::npos)
      << several.status().ToString();
}

TEST(LayerPackWriter, RefusesSmallBufferAndBadShapes) {
  LayerPackShape shape;
  shape.num_kv_heads = 2;
  shape.num_query_heads = 4;
  shape.head_dim = 8;
  const std::vector<LayerPackRequest> requests = {{1, 0, 1, 1}};
  const uint64_t size = *KvPackBytes(shape, requests);
  Bytes buffer(size - 1);
  auto small = LayerPackWriter::Create(shape, requests, buffer);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("has " + std::to_string(size - 1) + " bytes"),
            std::string::npos) << small.status().ToString();

  auto expect_error = [&](LayerPackShape s, std::vector<LayerPackRequest> r,
                          const std::string& text) {
    auto bytes = KvPackBytes(s, r);
    ASSERT_FALSE(bytes.ok()) << text;
    EXPECT_NE(bytes.status().message().find(text), std::string::npos)
        << bytes.status().ToString();
  };
  LayerPackShape bad = shape;
  bad.num_query_heads = 3;
  expect_error(bad, requests, "num_query_heads 3 is not a multiple of num_kv_heads 2");
  bad = shape;
  bad.head_dim = 0;
  expect_error(bad, requests, "'head_dim' is 0");
  expect_error(shape, {}, "'batch' is 0");
  expect_error(shape, {{1, 0, 0, 0}}, "'new_tokens' is 0");
  expect_error(shape, {{1, 0x7fffffff, 1, 0}}, "exceeds the largest int32 position");
}

// A valid KV pack to corrupt: P = 2, B = 2, bf16, query on.
struct SamplePack {
  LayerPackShape shape;
  std::vector<LayerPackRequest> requests;
  Bytes bytes;
};

SamplePack MakeSamplePack(LayerPackKind kind = LayerPackKind::kKvPack) {
  SamplePack pack;
  pack.shape = MakeShape(kind, 2, DType::kBF16, kind == LayerPackKind::kKvPack);
  pack.requests = {{11, 40, 1, 20}, {12, 8, 3, 11}};
  auto size = kind == LayerPackKind::kKvPack ? KvPackBytes(pack.shape, pack.requests)
                                             : ReplyPackBytes(pack.shape, pack.requests);
  pack.bytes.resize(*size);
  auto writer = LayerPackWriter::Create(pack.shape, pack.requests, pack.bytes);
  EXPECT_TRUE(writer.ok());
  return pack;
}

template <typename T>
void Poke(Bytes& bytes, size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof(value));
}

void ExpectParseError(const Bytes& bytes, const std::string& text,
                      StatusCode code = StatusCode::kDataLoss) {
  auto view = LayerPackView::Parse(bytes);
  ASSERT_FALSE(view.ok()) << "expected an error containing: " << text;
  EXPECT_EQ(view.status().code(), code) << view.status().ToString();
  EXPECT_NE(view.status().message().find(text), std::string::npos)
      << "error: " << view.status().ToString() << "\nexpected to contain: " << text;
}

TEST(LayerPackParse, RefusesEveryHeaderCorruption) {
  const SamplePack pack = MakeSamplePack();
  ASSERT_TRUE(LayerPackView::Parse(pack.bytes).ok());
  const uint64_t size = pack.bytes.size();
  Bytes b = pack.bytes;
  b[0] = std::byte{'X'};
  ExpectParseError(b, "'magic'");
  b = pack.bytes;
  // A peer of format version 1 (no attention sections) or 2 (no delta replies) is refused by
  // name.
  Poke<uint16_t>(b, offsetof(LayerPackHeader, version), 1);
  ExpectParseError(b, "'version' is 1, this build reads version 3 (the peer runs another rubato",
                   StatusCode::kUnsupported);
  Poke<uint16_t>(b, offsetof(LayerPackHeader, version), 2);
  ExpectParseError(b, "'version' is 2, this build reads version 3 (the peer runs another rubato",
                   StatusCode::kUnsupported);
  b = pack.bytes;
  Poke<uint8_t>(b, offsetof(LayerPackHeader, kind), 3);
  ExpectParseError(b, "'kind' is 3");
  b = pack.bytes;
  Poke<uint8_t>(b, offsetof(LayerPackHeader, dtype), 9);
  ExpectParseError(b, "'dtype' is 9");
  b = pack.bytes;
  Poke<uint32_t>(b, offsetof(LayerPackHeader, flags), 0x5);
  ExpectParseError(b, "'flags' is 0x5");
  b = pack.bytes;
  Poke<uint32_t>(b, offsetof(LayerPackHeader, reserved0), 1);
  ExpectParseError(b, "'reserved0'");
  // total_bytes larger and smaller than the buffer.
  b = pack.bytes;
  Poke<uint64_t>(b, offsetof(LayerPackHeader, total_bytes), size + 1);
  ExpectParseError(b, "'total_bytes' is " + std::to_string(size + 1) + " but the buffer has " +
                          std::to_string(size));
  Poke<uint64_t>(b, offsetof(LayerPackHeader, total_bytes), size - 1);
  ExpectParseError(b, "'total_bytes' is " + std::to_string(size - 1));
  // A buffer longer than the message it holds.
  b = pack.bytes;
  b.resize(size + 16);
  ExpectParseError(b, "but the buffer has " + std::to_string(size + 16));
  // total_bytes agrees with the buffer but not with the shape it describes.
  b = pack.bytes;
  Poke<uint32_t>(b, offsetof(LayerPackHeader, head_dim), 6);
  ExpectParseError(b, "describe a");
  b = pack.bytes;
  Poke<uint32_t>(b, offsetof(LayerPackHeader, num_query_heads), 5);
  ExpectParseError(b, "num_query_heads 5 is not a multiple of num_kv_heads 2");
  // A reply pack must not claim a query.
  SamplePack reply = MakeSamplePack(LayerPackKind::kReplyPack);
  ASSERT_TRUE(LayerPackView::Parse(reply.bytes).ok());
  Poke<uint32_t>(reply.bytes, offsetof(LayerPackHeader, flags), kLayerPackFlagHasQuery);
  ExpectParseError(reply.bytes, "a reply pack allows only 0x2");
}

TEST(LayerPackParse, RefusesCountsThatOverflowSizeMath) {
  SamplePack pack = MakeSamplePack();
  Bytes b = pack.bytes;
  // Counts whose products overflow 64 bits, with total_bytes matching the buffer.
  Poke<uint32_t>(b, offsetof(LayerPackHeader, num_layers), 0xffffffffu);
  Poke<uint32_t>(b, offsetof(LayerPackHeader, first_layer), 0);
  Poke<uint32_t>(b, offsetof(LayerPackHeader, num_kv_heads), 0x80000000u);
  Poke<uint32_t>(b, offsetof(LayerPackHeader, num_query_heads), 0x80000000u);
  Poke<uint32_t>(b, offsetof(LayerPackHeader, head_dim), 0xffffffffu);
  ExpectParseError(b, "overflows 64 bits");
  // A huge batch: its table would end far past the buffer; refused before any allocation.
  b = pack.bytes;
  Poke<uint32_t>(b, offsetof(LayerPackHeader, batch), 0xffffffffu);
  ExpectParseError(b, "'batch' is 4294967295");
  // Huge but non-overflowing counts: the computed size differs from the buffer.
  b = pack.bytes;
  Poke<uint32_t>(b, offsetof(LayerPackHeader, num_layers), 1u << 20);
  Poke<uint32_t>(b, offsetof(LayerPackHeader, first_layer), 0);
  ExpectParseError(b, "describe a");
}

TEST(LayerPackParse, RefusesBadRequestTable) {
  const SamplePack pack = MakeSamplePack();
  const size_t entry1 = sizeof(LayerPackHeader) + sizeof(LayerPackRequestEntry);
  Bytes b = pack.bytes;
  Poke<uint64_t>(b, entry1 + offsetof(LayerPackRequestEntry, session_id), 11);
  ExpectParseError(b, "request 1 repeats session id 11");
  b = pack.bytes;
  Poke<uint32_t>(b, entry1 + offsetof(LayerPackRequestEntry, new_tokens), 0);
  ExpectParseError(b, "'new_tokens' is 0");
  b = pack.bytes;
  Poke<uint32_t>(b, entry1 + offsetof(LayerPackRequestEntry, delta_rows), 5);
  ExpectParseError(b, "'delta_rows' is 5; it must be 0 outside a delta reply");
  b = pack.bytes;
  Poke<uint32_t>(b, entry1 + offsetof(LayerPackRequestEntry, delta_reset), 1);
  ExpectParseError(b, "'delta_reset' is 1; it must be 0 or 1, and 0 outside a delta pack");
  b = pack.bytes;
  Poke<uint32_t>(b, entry1 + offsetof(LayerPackRequestEntry, attention_queries), 5);
  ExpectParseError(b, "'attention_queries' is 5, must be 0 or 1");
  b = pack.bytes;
  Poke<uint32_t>(b, entry1 + offsetof(LayerPackRequestEntry, new_tokens), 4);
  ExpectParseError(b, "describe a");  // one more token: the payload would be larger
}

TEST(LayerPackParse, RefusesEveryTruncation) {
  for (LayerPackKind kind : {LayerPackKind::kKvPack, LayerPackKind::kReplyPack}) {
    const SamplePack pack = MakeSamplePack(kind);
    for (size_t length = 0; length < pack.bytes.size(); ++length) {
      // A fresh allocation of exactly `length` bytes, so ASan sees any read past it.
      Bytes truncated(pack.bytes.begin(), pack.bytes.begin() + static_cast<ptrdiff_t>(length));
      auto view = LayerPackView::Parse(truncated);
      ASSERT_FALSE(view.ok()) << "length " << length;
      EXPECT_EQ(view.status().code(), StatusCode::kDataLoss) << view.status().ToString();
    }
  }
}

TEST(LayerPackSession, RefusesEachMismatchedField) {
  const SamplePack pack = MakeSamplePack();
  auto view = LayerPackView::Parse(pack.bytes);
  ASSERT_TRUE(view.ok());
  SessionShape good;
  good.num_layers = 8;  // the pack holds layers [6, 8)
  good.num_kv_heads = 2;
  good.num_query_heads = 6;
  good.head_dim = 5;
  good.dtype = DType::kBF16;
  good.capacity_tokens = 64;
  ASSERT_TRUE(ValidateAgainstSession(*view, 0, good).ok());
  ASSERT_TRUE(ValidateAgainstSession(*view, 1, good).ok());
  auto expect = [&](SessionShape session, uint32_t request, const std::string& text) {
    const Status status = ValidateAgainstSession(*view, request, session);
    ASSERT_FALSE(status.ok()) << text;
    EXPECT_NE(status.message().find(text), std::string::npos) << status.ToString();
  };
  SessionShape s = good;
  s.num_layers = 7;
  expect(s, 0, "layers [6, 8) of the pack exceed the session's num_layers 7");
  s = good;
  s.num_kv_heads = 1;
  expect(s, 0, "'num_kv_heads' is 2 in the pack but 1 in the session");
  s = good;
  s.num_query_heads = 12;
  expect(s, 0, "'num_query_heads' is 6 in the pack but 12 in the session");
  s = good;
  s.head_dim = 128;
  expect(s, 0, "'head_dim' is 5 in the pack but 128 in the session");
  s = good;
  s.dtype = DType::kF16;
  expect(s, 0, "'dtype' is bf16 in the pack but f16 in the session");
  s = good;
  s.capacity_tokens = 40;  // request 0 writes position 40
  expect(s, 0, "first_position 40 + new_tokens 1 = 41 exceeds the session's capacity_tokens 40");
  expect(good, 2, "request index 2 is not below batch 2");

  // reply_slots past the positions that will exist after the append (8 + 3 = 11).
  SamplePack wide;
  wide.shape = pack.shape;
  wide.requests = {{12, 8, 3, 12}};
  wide.bytes.resize(*KvPackBytes(wide.shape, wide.requests));
  ASSERT_TRUE(LayerPackWriter::Create(wide.shape, wide.requests, wide.bytes).ok());
  auto wide_view = LayerPackView::Parse(wide.bytes);
  ASSERT_TRUE(wide_view.ok());
  const Status status = ValidateAgainstSession(*wide_view, 0, good);
  EXPECT_NE(status.message().find("reply_slots 12 exceeds the 11 positions"), std::string::npos)
      << status.ToString();
}

TEST(LayerPackReply, ContentValidation) {
  SamplePack reply = MakeSamplePack(LayerPackKind::kReplyPack);
  // Request 0 (first 40, new 1, 20 slots), request 1 (first 8, new 3, 11 slots): head h of
  // every layer selects positions {h, h + 2, ..., } count 3.
  auto writer = LayerPackWriter::Create(reply.shape, reply.requests, reply.bytes);
  ASSERT_TRUE(writer.ok());
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t r = 0; r < 2; ++r) {
      const uint32_t slots = reply.requests[r].reply_slots;
      for (uint32_t h = 0; h < 2; ++h) {
        StoreInt32(writer->Counts(l, r), h, 3);
        for (uint32_t i = 0; i < slots; ++i) {
          StoreInt32(writer->Positions(l, r), h * slots + i,
                     i < 3 ? static_cast<int32_t>(h + 2 * i) : -1);
        }
      }
    }
  }
  auto view = LayerPackView::Parse(reply.bytes);
  ASSERT_TRUE(view.ok());
  ASSERT_TRUE(ValidateReplyContents(*view).ok()) << ValidateReplyContents(*view).ToString();
  auto expect = [&](const std::string& text) {
    auto v = LayerPackView::Parse(reply.bytes);
    ASSERT_TRUE(v.ok());
    const Status status = ValidateReplyContents(*v);
    ASSERT_FALSE(status.ok()) << text;
    EXPECT_NE(status.message().find(text), std::string::npos) << status.ToString();
  };
  StoreInt32(writer->Counts(1, 1), 1, 12);
  expect("layer 7, request 1 (session 12), kv head 1: count 12 is outside [0, reply_slots 11]");
  StoreInt32(writer->Counts(1, 1), 1, 3);
  StoreInt32(writer->Positions(0, 1), 1, 0);  // 0, 0, 4: not ascending
  expect("position[1] = 0 is not ascending after 0");
  StoreInt32(writer->Positions(0, 1), 1, 11);  // 0, 11, 4: 11 is not below 8 + 3
  expect("position[1] = 11");
  StoreInt32(writer->Positions(0, 1), 1, 2);
  StoreInt32(writer->Positions(0, 0), 5, 7);  // padding past the count
  expect("position[5] = 7 past count 3 must be -1");
  StoreInt32(writer->Positions(0, 0), 5, -1);
  ASSERT_TRUE(ValidateReplyContents(*LayerPackView::Parse(reply.bytes)).ok());
  // A KV pack is not a reply.
  const SamplePack kv = MakeSamplePack();
  EXPECT_FALSE(ValidateReplyContents(*LayerPackView::Parse(kv.bytes)).ok());
}

TEST(LayerPackReply, AttentionLseMustBeFinite) {
  LayerPackShape shape;
  shape.kind = LayerPackKind::kReplyPack;
  shape.num_kv_heads = 1;
  shape.num_query_heads = 2;
  shape.head_dim = 4;
  const std::vector<LayerPackRequest> requests = {{1, 3, 1, 0, 1}};
  Bytes bytes(*ReplyPackBytes(shape, requests));
  auto writer = LayerPackWriter::Create(shape, requests, bytes);
  ASSERT_TRUE(writer.ok());
  StoreInt32(writer->Counts(0, 0), 0, 0);
  const float lse[2] = {1.5f, std::numeric_limits<float>::quiet_NaN()};
  std::memcpy(writer->AttentionLse(0, 0).data(), lse, sizeof(lse));
  const Status status = ValidateReplyContents(*LayerPackView::Parse(bytes));
  EXPECT_NE(status.message().find("attention lse[1] is nan, not finite"), std::string::npos)
      << status.ToString();
}

}  // namespace
}  // namespace rubato
