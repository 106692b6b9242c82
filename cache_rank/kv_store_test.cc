// Tests for the cache rank's KV store: sessions and the byte budget, appends of layer packs
// (bit-exact gathers afterwards, layer order, contiguity, all-or-nothing on a bad entry),
// gather errors, reply packs equal to direct gathers, and Stats read from another thread.
#include "cache_rank/kv_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cache_rank/exact_top_k.h"
#include "cache_rank/reply_builder.h"
#include "cache_rank/store_test_util.h"

namespace rubato {
namespace {

using cache_rank_test::BuildKvPack;
using cache_rank_test::RowPatternByte;
using cache_rank_test::Snapshot;

SessionShape SmallShape(DType dtype = DType::kBF16, uint32_t capacity = 32) {
  SessionShape shape;
  shape.num_layers = 4;
  shape.num_kv_heads = 2;
  shape.num_query_heads = 4;
  shape.head_dim = 8;
  shape.dtype = dtype;
  shape.capacity_tokens = capacity;
  return shape;
}

uint64_t SessionBytes(const SessionShape& s) {
  return 2ull * s.num_layers * s.num_kv_heads * s.capacity_tokens * s.head_dim *
         DTypeSize(s.dtype);
}

::testing::AssertionResult ContainsText(const Status& status, const std::string& text) {
  if (status.ok()) return ::testing::AssertionFailure() << "ok, expected: " << text;
  if (status.message().find(text) == std::string::npos) {
    return ::testing::AssertionFailure() << "'" << status.message() << "' lacks '" << text << "'";
  }
  return ::testing::AssertionSuccess();
}

TEST(KvStoreSessions, OpenCloseAndBudget) {
  const SessionShape shape = SmallShape();
  const uint64_t bytes = SessionBytes(shape);  // 2*4*2*32*8*2 = 8192
  KvStore store({.budget_bytes = 2 * bytes + bytes / 2, .allocator = nullptr});
  auto a = store.OpenSession(100, shape);
  auto b = store.OpenSession(101, shape);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_EQ(store.Stats().sessions_open, 2u);
  EXPECT_EQ(store.Stats().bytes_reserved, 2 * bytes);
  EXPECT_EQ(store.Stats().budget_bytes, 2 * bytes + bytes / 2);
  EXPECT_EQ(*store.SessionLength(*a), 0u);

  auto refused = store.OpenSession(102, shape);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(ContainsText(refused.status(),
                           "needs " + std::to_string(bytes) + " bytes (4 layers x 2 KV heads x "
                           "32 tokens x head_dim 8, bf16, K and V) but " +
                               std::to_string(2 * bytes) + " of the budget's " +
                               std::to_string(2 * bytes + bytes / 2) + " bytes are in use"));
  EXPECT_EQ(store.Stats().sessions_open, 2u);

  EXPECT_TRUE(ContainsText(store.OpenSession(100, shape).status(),
                           "request 100 already has session"));
  ASSERT_TRUE(store.CloseSession(*a).ok());
  EXPECT_EQ(store.Stats().bytes_reserved, bytes);
  EXPECT_TRUE(store.OpenSession(102, shape).ok());  // fits again
  EXPECT_TRUE(store.OpenSession(100, shape).status().code() == StatusCode::kResourceExhausted);

  const Status unknown = store.CloseSession(*a);
  EXPECT_EQ(unknown.code(), StatusCode::kNotFound);
  EXPECT_TRUE(ContainsText(unknown, "session " + std::to_string(*a) + " is not open"));
  EXPECT_EQ(store.SessionLength(999).status().code(), StatusCode::kNotFound);

  SessionShape bad = shape;
  bad.capacity_tokens = 0;
  EXPECT_TRUE(ContainsText(store.OpenSession(200, bad).status(), "'capacity_tokens' is 0"));
  bad = shape;
  bad.num_query_heads = 3;
  EXPECT_TRUE(ContainsText(store.OpenSession(200, bad).status(),
                           "num_query_heads 3 is not a multiple of num_kv_heads 2"));
  bad = shape;
  bad.num_layers = 0xffffffffu;
  bad.capacity_tokens = 0x7fffffffu;
  bad.head_dim = 0xffffffffu;
  EXPECT_TRUE(ContainsText(store.OpenSession(200, bad).status(), "overflows 64-bit sizes"));
}

// Session A: prefill chunk of 5 tokens, then 3 decode steps; session B joins at step 2 with a
// chunk of 3. Packs of P = 2 layers (layers 0-1, then 2-3).
class KvStoreAppend : public ::testing::TestWithParam<DType> {};

TEST_P(KvStoreAppend, AppendThenGatherIsBitExact) {
  const SessionShape shape = SmallShape(GetParam());
  KvStore store({.budget_bytes = 1 << 20, .allocator = nullptr});
  const uint64_t a = *store.OpenSession(1, shape);
  const uint64_t b = *store.OpenSession(2, shape);
  uint32_t length_a = 0;
  uint32_t length_b = 0;
  for (uint64_t step = 1; step <= 4; ++step) {
    std::vector<LayerPackRequest> requests;
    const uint32_t new_a = step == 1 ? 5 : 1;
    requests.push_back({a, length_a, new_a, length_a + new_a});
    if (step >= 2) requests.push_back({b, length_b, step == 2 ? 3u : 1u, 1});
    for (uint32_t first = 0; first < 4; first += 2) {
      auto pack = BuildKvPack(shape, step, first, 2, requests);
      const Status status = store.AppendKvPack(pack.view);
      ASSERT_TRUE(status.ok()) << status.ToString();
      if (first == 0) {  // mid-step: length unchanged, layers 0-1 readable one step ahead
        EXPECT_EQ(*store.SessionLength(a), length_a);
        EXPECT_EQ(*store.LayerLength(a, 1), length_a + new_a);
        EXPECT_EQ(*store.LayerLength(a, 2), length_a);
      }
    }
    length_a += new_a;
    if (step >= 2) length_b += requests[1].new_tokens;
    EXPECT_EQ(*store.SessionLength(a), length_a);
    EXPECT_EQ(*store.SessionLength(b), length_b);
  }
  ASSERT_EQ(length_a, 8u);
  ASSERT_EQ(length_b, 5u);
  EXPECT_EQ(store.Stats().appends, 8u);
  const size_t row_bytes = shape.head_dim * DTypeSize(shape.dtype);
  EXPECT_EQ(store.Stats().bytes_appended, (8u + 5u) * 4 * 2 * 2 * row_bytes);

  // Gather every stored position in a shuffled order, for every layer and head.
  std::mt19937 rng(7);
  for (const auto& [session, length] : {std::pair{a, length_a}, std::pair{b, length_b}}) {
    std::vector<int32_t> positions(length);
    std::iota(positions.begin(), positions.end(), 0);
    std::shuffle(positions.begin(), positions.end(), rng);
    positions.push_back(positions[0]);  // repeats are allowed
    for (uint32_t layer = 0; layer < 4; ++layer) {
      for (uint32_t h = 0; h < 2; ++h) {
        std::vector<std::byte> keys(positions.size() * row_bytes);
        std::vector<std::byte> values(positions.size() * row_bytes);
        ASSERT_TRUE(store.Gather(session, layer, h, positions, keys, values).ok());
        for (size_t i = 0; i < positions.size(); ++i) {
          for (size_t j = 0; j < row_bytes; ++j) {
            const uint32_t p = static_cast<uint32_t>(positions[i]);
            ASSERT_EQ(keys[i * row_bytes + j], RowPatternByte(session, layer, 0, h, p, j))
                << "session " << session << " layer " << layer << " head " << h << " pos " << p;
            ASSERT_EQ(values[i * row_bytes + j], RowPatternByte(session, layer, 1, h, p, j));
          }
        }
      }
    }
  }
  EXPECT_EQ(store.Stats().gathers, 2u * 4 * 2);
}

INSTANTIATE_TEST_SUITE_P(DTypes, KvStoreAppend,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16));

TEST(KvStoreAppendErrors, InvalidEntryAnywhereWritesNothing) {
  const SessionShape shape = SmallShape(DType::kF32, 8);
  SessionShape other = shape;
  other.head_dim = 4;
  KvStore store({.budget_bytes = 1 << 20, .allocator = nullptr});
  const uint64_t a = *store.OpenSession(1, shape);
  const uint64_t b = *store.OpenSession(2, shape);
  const uint64_t c = *store.OpenSession(3, other);
  // Two tokens in a and b first.
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 1, 0, 4, {{a, 0, 2, 2}, {b, 0, 2, 2}}).view)
                  .ok());
  const auto before = Snapshot(store, {a, b, c});
  auto expect_refused = [&](const std::vector<LayerPackRequest>& requests,
                            const std::string& text) {
    auto pack = BuildKvPack(shape, 2, 0, 4, requests);
    EXPECT_TRUE(ContainsText(store.AppendKvPack(pack.view), text));
    EXPECT_TRUE(Snapshot(store, {a, b, c}) == before) << "store changed by: " << text;
  };
  // The first two entries are valid; the last one is not.
  expect_refused({{a, 2, 1, 3}, {b, 2, 1, 3}, {77, 0, 1, 1}}, "session 77 is not open");
  expect_refused({{a, 2, 1, 3}, {b, 2, 1, 3}, {c, 0, 1, 1}},
                 "'head_dim' is 8 in the pack but 4 in the session");
  expect_refused({{a, 2, 1, 3}, {b, 2, 7, 3}}, "= 9 exceeds the session's capacity_tokens 8");
  expect_refused({{a, 2, 1, 3}, {b, 2, 1, 4}}, "reply_slots 4 exceeds the 3 positions");
  // Non-contiguous appends: a gap and an overwrite.
  expect_refused({{a, 2, 1, 1}, {b, 3, 1, 1}},
                 "first_position is 3 but the session holds 2 tokens (appends must be "
                 "contiguous)");
  expect_refused({{a, 1, 1, 1}}, "first_position is 1 but the session holds 2 tokens");
  // A pack with layers beyond the model.
  SessionShape wide = shape;
  wide.num_layers = 6;
  auto beyond = BuildKvPack(wide, 2, 0, 6, {{a, 2, 1, 1}});
  EXPECT_TRUE(ContainsText(store.AppendKvPack(beyond.view),
                           "layers [0, 6) of the pack exceed the session's num_layers 4"));
  EXPECT_TRUE(Snapshot(store, {a, b, c}) == before);
}

TEST(KvStoreAppendErrors, LayerOrderAndSteps) {
  const SessionShape shape = SmallShape(DType::kF16, 8);
  KvStore store({.budget_bytes = 1 << 20, .allocator = nullptr});
  const uint64_t a = *store.OpenSession(1, shape);
  auto refuse = [&](uint64_t step, uint32_t first, uint32_t layers, LayerPackRequest request,
                    const std::string& text) {
    const auto before = Snapshot(store, {a});
    EXPECT_TRUE(ContainsText(
        store.AppendKvPack(BuildKvPack(shape, step, first, layers, {request}).view), text));
    EXPECT_TRUE(Snapshot(store, {a}) == before) << text;
  };
  // Skips layers 0-1 at the start of a step.
  refuse(5, 2, 2, {a, 0, 1, 1}, "the pack starts at layer 2 but the session expects layer 0");
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 5, 0, 2, {{a, 0, 1, 1}}).view).ok());
  // Repeats layers 0-1; then a pack that skips layer 2; then the right layers of another step.
  refuse(5, 0, 2, {a, 0, 1, 1}, "the pack starts at layer 0 but the session expects layer 2");
  refuse(5, 3, 1, {a, 0, 1, 1}, "the pack starts at layer 3 but the session expects layer 2");
  refuse(6, 2, 2, {a, 0, 1, 1}, "step 6 with 1 new tokens, but the step in progress is step 5");
  refuse(5, 2, 2, {a, 0, 2, 1}, "step 5 with 2 new tokens, but the step in progress");
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 5, 2, 2, {{a, 0, 1, 1}}).view).ok());
  EXPECT_EQ(*store.SessionLength(a), 1u);
  // A completed step number cannot come back.
  refuse(5, 0, 4, {a, 1, 1, 1}, "step 5 is not after the last completed step 5");
  // Uneven packs (3 layers then 1) are fine.
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 6, 0, 3, {{a, 1, 1, 1}}).view).ok());
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 6, 3, 1, {{a, 1, 1, 1}}).view).ok());
  EXPECT_EQ(*store.SessionLength(a), 2u);
  // A reply pack is not appendable.
  LayerPackShape reply_shape = BuildKvPack(shape, 7, 0, 4, {{a, 2, 1, 1}}).view.shape();
  reply_shape.kind = LayerPackKind::kReplyPack;
  std::vector<LayerPackRequest> requests = {{a, 2, 1, 1}};
  std::vector<std::byte> reply(*ReplyPackBytes(reply_shape, requests));
  ASSERT_TRUE(LayerPackWriter::Create(reply_shape, requests, reply).ok());
  EXPECT_TRUE(ContainsText(store.AppendKvPack(*LayerPackView::Parse(reply)),
                           "AppendKvPack got a reply pack"));
}

TEST(KvStoreGather, RefusesBadArguments) {
  const SessionShape shape = SmallShape(DType::kF32, 8);
  KvStore store({.budget_bytes = 1 << 20, .allocator = nullptr});
  const uint64_t a = *store.OpenSession(1, shape);
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 1, 0, 4, {{a, 0, 3, 3}}).view).ok());
  std::vector<std::byte> keys(2 * 32, std::byte{0x5a});
  std::vector<std::byte> values(2 * 32, std::byte{0x5a});
  const std::vector<std::byte> untouched = keys;
  auto gather = [&](uint64_t session, uint32_t layer, uint32_t head,
                    std::vector<int32_t> positions, size_t out_bytes) {
    return store.Gather(session, layer, head, positions,
                        std::span(keys).first(out_bytes), std::span(values).first(out_bytes));
  };
  EXPECT_TRUE(ContainsText(gather(a, 0, 0, {0, 3}, 64), "positions[1] = 3 is outside the 3 "
                                                        "stored tokens"));
  EXPECT_TRUE(ContainsText(gather(a, 0, 0, {-1}, 64), "positions[0] = -1"));
  EXPECT_TRUE(ContainsText(gather(a, 0, 0, {0, 1}, 63), "needs 64 bytes per output"));
  EXPECT_TRUE(ContainsText(gather(a, 4, 0, {0}, 64), "layer 4 / kv head 0 outside"));
  EXPECT_TRUE(ContainsText(gather(a, 0, 2, {0}, 64), "layer 0 / kv head 2 outside"));
  EXPECT_TRUE(ContainsText(gather(a + 100, 0, 0, {0}, 64), "is not open"));
  EXPECT_EQ(keys, untouched);
  EXPECT_EQ(store.Stats().gathers, 0u);
}

TEST(KvStoreReply, RowsEqualDirectGathers) {
  const SessionShape shape = SmallShape(DType::kBF16, 16);
  KvStore store({.budget_bytes = 1 << 20, .allocator = nullptr});
  const uint64_t a = *store.OpenSession(1, shape);
  const uint64_t b = *store.OpenSession(2, shape);
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 1, 0, 4, {{a, 0, 9, 1}, {b, 0, 4, 1}}).view)
                  .ok());
  // Step 2: layers 0-1 of a pack of two; a asks for 5 slots, b (offload-dense) for all 5.
  const std::vector<LayerPackRequest> requests = {{a, 9, 1, 5}, {b, 4, 1, 5}};
  auto pack = BuildKvPack(shape, 2, 0, 2, requests);
  ASSERT_TRUE(store.AppendKvPack(pack.view).ok());
  // Selections: a by exact top-k with k 3 over the 10 readable tokens; b: every position.
  std::vector<float> query(size_t{shape.num_query_heads} * shape.head_dim);
  for (size_t i = 0; i < query.size(); ++i) query[i] = static_cast<float>(i % 5) - 2.0f;
  std::vector<KvHeadSelection> selections;
  for (uint32_t l = 0; l < 2; ++l) {
    auto top = ExactTopK(store, a, l, query, 3, 0, 10);
    ASSERT_TRUE(top.ok()) << top.status().ToString();
    selections.push_back(*top);
    selections.push_back({{0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}});
  }
  selections[2][1] = {};  // layer 1, request a, head 1: nothing selected
  std::vector<std::byte> out(*ReplyPackBytes(pack.view.shape(), requests), std::byte{0x77});
  auto written = BuildReplyPack(store, pack.view, selections, out);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  ASSERT_EQ(*written, out.size());
  auto reply = LayerPackView::Parse(out);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  ASSERT_TRUE(ValidateReplyContents(*reply).ok());
  EXPECT_EQ(reply->step(), 2u);
  const size_t row_bytes = shape.head_dim * 2;
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t r = 0; r < 2; ++r) {
      const uint32_t slots = requests[r].reply_slots;
      for (uint32_t h = 0; h < 2; ++h) {
        const std::vector<int32_t>& chosen = selections[l * 2 + r][h];
        ASSERT_EQ(LoadInt32(reply->Counts(l, r), h), static_cast<int32_t>(chosen.size()));
        std::vector<std::byte> keys(slots * row_bytes, std::byte{0});
        std::vector<std::byte> values(slots * row_bytes, std::byte{0});
        ASSERT_TRUE(store.Gather(requests[r].session_id, l, h, chosen, keys, values).ok());
        for (uint32_t i = 0; i < slots; ++i) {
          EXPECT_EQ(LoadInt32(reply->Positions(l, r), h * slots + i),
                    i < chosen.size() ? chosen[i] : -1);
        }
        const auto reply_keys = reply->Key(l, r).subspan(h * slots * row_bytes,
                                                         slots * row_bytes);
        const auto reply_values = reply->Value(l, r).subspan(h * slots * row_bytes,
                                                             slots * row_bytes);
        // Rows past the count are zero, like the zero-initialized direct-gather buffers.
        EXPECT_TRUE(std::equal(keys.begin(), keys.end(), reply_keys.begin()))
            << "layer " << l << " request " << r << " head " << h;
        EXPECT_TRUE(std::equal(values.begin(), values.end(), reply_values.begin()));
      }
    }
  }
  // Bad selections are refused before anything is written.
  const std::vector<std::byte> good = out;
  auto bad = selections;
  bad[1][0] = {2, 1};
  EXPECT_TRUE(ContainsText(BuildReplyPack(store, pack.view, bad, out).status(),
                           "position[1] = 1 is not ascending after 2"));
  bad = selections;
  bad[3][1] = {0, 1, 2, 3, 4, 5};
  EXPECT_TRUE(ContainsText(BuildReplyPack(store, pack.view, bad, out).status(),
                           "6 positions selected, more than reply_slots 5"));
  bad = selections;
  bad[0][0] = {10};  // layer 0 of a holds 10 tokens
  EXPECT_TRUE(ContainsText(BuildReplyPack(store, pack.view, bad, out).status(),
                           "not below the 10 readable tokens"));
  bad.pop_back();
  EXPECT_TRUE(ContainsText(BuildReplyPack(store, pack.view, bad, out).status(),
                           "3 selections given, expected num_layers 2 x batch 2 = 4"));
  EXPECT_EQ(out, good);
  std::vector<std::byte> small(out.size() - 1);
  EXPECT_TRUE(ContainsText(BuildReplyPack(store, pack.view, selections, small).status(),
                           "the output buffer has"));
}

TEST(KvStoreStats, ReadableFromAnotherThread) {
  const SessionShape shape = SmallShape(DType::kF32, 64);
  KvStore store({.budget_bytes = 1 << 22, .allocator = nullptr});
  const uint64_t a = *store.OpenSession(1, shape);
  std::atomic<bool> done{false};
  uint64_t last_seen = 0;
  bool monotonic = true;
  std::thread reader([&] {
    while (!done.load()) {
      const uint64_t appends = store.Stats().appends;
      monotonic = monotonic && appends >= last_seen;
      last_seen = appends;
    }
  });
  bool appended = true;
  for (uint32_t step = 0; step < 64 && appended; ++step) {
    appended = store.AppendKvPack(BuildKvPack(shape, step + 1, 0, 4, {{a, step, 1, 1}}).view)
                   .ok();
  }
  done.store(true);  // joined below whatever happened, so the reader never outlives the store
  EXPECT_TRUE(appended);
  reader.join();
  EXPECT_TRUE(monotonic);
  EXPECT_EQ(store.Stats().appends, 64u);
  EXPECT_EQ(*store.SessionLength(a), 64u);
}

}  // namespace
}  // namespace rubato
