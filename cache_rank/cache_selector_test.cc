// Tests for the cache selectors and their table: the registered names and traits, the refusal of
// an unknown name and of bad parameters (by the table, CacheService::OpenSession and the RPC's
// OpenSession), the RPC's names ("topk" is oracle_topk, no name the retired whole-prefix
// "dense"), each selector's reply range, and Select against the store: attention gives no rows
// (its reply is the attention of the query, stored_attention_test.cc), oracle_topk the sink plus
// ExactTopK of the pack's query.
#include "cache_rank/cache_selector.h"

#include <gtest/gtest.h>

#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cache_rank/cache_rpc_handler.h"
#include "cache_rank/cache_service.h"
#include "cache_rank/exact_top_k.h"

namespace rubato {

void PrintTo(const ReplyRange& range, std::ostream* out) {
  *out << "{sink_end " << range.sink_end << ", recent_begin " << range.recent_begin << ", slots "
       << range.slots << ", attention_queries " << range.attention_queries << "}";
}

namespace {

CacheSelectorSpec OracleTopK(int top_k, int sink_tokens, int recent_tokens) {
  return {.name = "oracle_topk",
          .top_k = top_k,
          .sink_tokens = sink_tokens,
          .recent_tokens = recent_tokens};
}

const CacheSelector& Selector(const std::string& name) {
  const CacheSelector* selector = FindCacheSelector(name);
  EXPECT_NE(selector, nullptr) << name;
  return selector != nullptr ? *selector : *FindCacheSelector("attention");
}

TEST(CacheSelectorTable, ListsAttentionAndOracleTopKWithTheirTraits) {
  EXPECT_EQ(CacheSelectorNames(),
            (std::vector<std::string>{"attention", "oracle_topk", "asyncspade"}));
  EXPECT_EQ(Selector("attention").name(), "attention");
  EXPECT_TRUE(Selector("attention").traits().needs_query);
  EXPECT_TRUE(Selector("attention").traits().serves_same_step);
  EXPECT_TRUE(Selector("attention").traits().partial_attention);
  EXPECT_EQ(Selector("oracle_topk").name(), "oracle_topk");
  EXPECT_TRUE(Selector("oracle_topk").traits().needs_query);
  EXPECT_TRUE(Selector("oracle_topk").traits().serves_same_step);
  EXPECT_FALSE(Selector("oracle_topk").traits().partial_attention);
  // The whole-prefix selector is gone: attention replaces it.
  EXPECT_EQ(FindCacheSelector("dense"), nullptr);
  // "topk" is the RPC's old name, not a selector of the table.
  EXPECT_EQ(FindCacheSelector("topk"), nullptr);
  EXPECT_EQ(FindCacheSelector(""), nullptr);
}

TEST(CacheSelectorTable, RefusesAnUnknownNameByName) {
  const Result<const CacheSelector*> unknown = ResolveCacheSelector({.name = "quest"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.status().message(),
            "cache rank: unknown selector 'quest' (known: attention, oracle_topk, asyncspade)");
}

TEST(CacheSelectorTable, ValidationNamesTheField) {
  ASSERT_TRUE(ResolveCacheSelector(CacheSelectorSpec()).ok());
  ASSERT_TRUE(ResolveCacheSelector(OracleTopK(1, 0, 1)).ok());
  // Attention reads none of the numbers.
  EXPECT_TRUE(ResolveCacheSelector({.name = "attention", .top_k = 0, .recent_tokens = 0}).ok());
  const std::pair<CacheSelectorSpec, std::string> bad[] = {
      {OracleTopK(0, 4, 256), "top_k must be >= 1, got 0"},
      {OracleTopK(8, -1, 256), "sink_tokens must be >= 0, got -1"},
      {OracleTopK(8, 4, 0), "recent_tokens must be >= 1, got 0"},
  };
  for (const auto& [spec, complaint] : bad) {
    const Result<const CacheSelector*> refused = ResolveCacheSelector(spec);
    ASSERT_FALSE(refused.ok()) << complaint;
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(refused.status().message(), "cache rank: selector oracle_topk: " + complaint);
  }
}

TEST(CacheSelectorReplyRange, AttentionCarriesNoRowsAndTheDecodeQuerysAttention) {
  const CacheSelector& attention = Selector("attention");
  EXPECT_EQ(attention.ReplyRangeFor({}, 0, 16), (ReplyRange{0, 16, 0, 0}));  // a prefill chunk
  EXPECT_EQ(attention.ReplyRangeFor({}, 16, 1), (ReplyRange{0, 17, 0, 1}));
  // The same at every context length: the reply does not grow with it.
  EXPECT_EQ(attention.ReplyRangeFor({}, 60000, 1), (ReplyRange{0, 60001, 0, 1}));
  EXPECT_EQ(attention.ReplyRangeFor(OracleTopK(2, 1, 1), 16, 1), (ReplyRange{0, 17, 0, 1}));
}

TEST(CacheSelectorReplyRange, OracleTopKCarriesTheSinkAndTopKBeforeTheRecentWindow) {
  const CacheSelector& topk = Selector("oracle_topk");
  // Prefill chunks attend locally: nothing comes back.
  EXPECT_EQ(topk.ReplyRangeFor(OracleTopK(3, 2, 4), 0, 16), (ReplyRange{0, 16, 0}));
  // L = 10: recent [6, 10), sink [0, 2), then 3 of [2, 6).
  EXPECT_EQ(topk.ReplyRangeFor(OracleTopK(3, 2, 4), 9, 1), (ReplyRange{2, 6, 5}));
  // top_k covering [sink_end, recent_begin): every position before the recent window.
  EXPECT_EQ(topk.ReplyRangeFor(OracleTopK(100, 2, 4), 9, 1), (ReplyRange{2, 6, 6}));
  // A context shorter than the recent window: nothing to select, not even the sink.
  EXPECT_EQ(topk.ReplyRangeFor(OracleTopK(3, 2, 4), 2, 1), (ReplyRange{0, 0, 0}));
  // A sink longer than the context before the recent window is cut at recent_begin.
  EXPECT_EQ(topk.ReplyRangeFor(OracleTopK(3, 8, 4), 9, 1), (ReplyRange{6, 6, 6}));
}

TEST(CacheSelectorSpecFromRpc, NoNameIsTheRetiredDenseAndTopkIsOracleTopK) {
  rpc::OpenSessionRequest request;
  // Peers that never set the field wanted whole-prefix replies: refused at OpenSession by name.
  EXPECT_EQ(SelectorSpecFromRequest(request).name, "dense");
  request.set_selector("topk");
  request.set_top_k(64);
  request.set_sink_tokens(2);
  request.set_recent_tokens(16);
  const CacheSelectorSpec old_name = SelectorSpecFromRequest(request);
  EXPECT_EQ(old_name.name, "oracle_topk");
  EXPECT_EQ(old_name.top_k, 64);
  EXPECT_EQ(old_name.sink_tokens, 2);
  EXPECT_EQ(old_name.recent_tokens, 16);
  request.set_selector("oracle_topk");
  EXPECT_EQ(SelectorSpecFromRequest(request).name, "oracle_topk");
  request.set_selector("quest");
  EXPECT_EQ(SelectorSpecFromRequest(request).name, "quest");  // refused at OpenSession
}

// A session shape and KV packs with random keys and queries, appended to a store.
class CacheSelectorSelectTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kPrefillTokens = 15;

  void SetUp() override {
    shape_.num_layers = 2;
    shape_.num_kv_heads = 2;
    shape_.num_query_heads = 4;
    shape_.head_dim = 8;
    shape_.dtype = DType::kF32;
    shape_.capacity_tokens = 32;
    auto session = store_.OpenSession(/*request_id=*/7, shape_);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    session_ = *session;
    prefill_ = Append(0, kPrefillTokens, /*has_query=*/false);
    decode_ = Append(kPrefillTokens, 1, /*has_query=*/true);
  }

  // Writes and appends a KV pack of every layer for one entry of `tokens` positions.
  LayerPackView Append(uint32_t first_position, uint32_t tokens, bool has_query) {
    LayerPackShape pack;
    pack.kind = LayerPackKind::kKvPack;
    pack.step = ++step_;
    pack.num_layers = shape_.num_layers;
    pack.dtype = shape_.dtype;
    pack.num_kv_heads = shape_.num_kv_heads;
    pack.num_query_heads = shape_.num_query_heads;
    pack.head_dim = shape_.head_dim;
    pack.has_query = has_query;
    const std::vector<LayerPackRequest> requests = {
        {.session_id = session_, .first_position = first_position, .new_tokens = tokens}};
    std::vector<std::byte>& bytes = buffers_.emplace_back();
    auto size = KvPackBytes(pack, requests);
    EXPECT_TRUE(size.ok()) << size.status().ToString();
    bytes.resize(size.ok() ? *size : 0);
    auto writer = LayerPackWriter::Create(pack, requests, bytes);
    EXPECT_TRUE(writer.ok()) << writer.status().ToString();
    if (!writer.ok()) return LayerPackView();
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint32_t layer = 0; layer < pack.num_layers; ++layer) {
      for (std::span<std::byte> section :
           {writer->Key(layer, 0), writer->Value(layer, 0), writer->Query(layer, 0)}) {
        if (section.empty()) continue;  // no query in a prefill pack
        std::vector<float> values(section.size() / sizeof(float));
        for (float& value : values) value = 2.0f * normal(rng_);
        std::memcpy(section.data(), values.data(), section.size());
      }
    }
    auto view = LayerPackView::Parse(bytes);
    EXPECT_TRUE(view.ok()) << view.status().ToString();
    const Status appended = store_.AppendKvPack(*view);
    EXPECT_TRUE(appended.ok()) << appended.ToString();
    return *view;
  }

  std::vector<float> Query(uint32_t layer) const {
    const std::span<const std::byte> bytes = decode_.Query(layer, 0);
    std::vector<float> query(bytes.size() / sizeof(float));
    std::memcpy(query.data(), bytes.data(), bytes.size());
    return query;
  }

  KvStore store_{KvStoreOptions{uint64_t{1} << 20, nullptr}};
  SessionShape shape_;
  uint64_t session_ = 0;
  uint64_t step_ = 0;
  std::mt19937 rng_{11};
  std::vector<std::vector<std::byte>> buffers_;
  LayerPackView prefill_;
  LayerPackView decode_;
};

TEST_F(CacheSelectorSelectTest, AttentionSelectsNoRows) {
  for (uint32_t layer = 0; layer < shape_.num_layers; ++layer) {
    auto selection = Selector("attention").Select({}, store_, decode_, layer, 0, nullptr);
    ASSERT_TRUE(selection.ok()) << selection.status().ToString();
    EXPECT_EQ(*selection, KvHeadSelection(shape_.num_kv_heads)) << "layer " << layer;
  }
}

TEST_F(CacheSelectorSelectTest, OracleTopKSelectsTheSinkThenTheExactTopKOfThePacksQuery) {
  // L = 16, recent [13, 16), sink [0, 2), then 4 of [2, 13).
  const CacheSelectorSpec spec = OracleTopK(4, 2, 3);
  for (uint32_t layer = 0; layer < shape_.num_layers; ++layer) {
    auto selection = Selector("oracle_topk").Select(spec, store_, decode_, layer, 0, nullptr);
    ASSERT_TRUE(selection.ok()) << selection.status().ToString();
    auto top = ExactTopK(store_, session_, layer, Query(layer), 4, 2, 13);
    ASSERT_TRUE(top.ok()) << top.status().ToString();
    ASSERT_EQ(selection->size(), shape_.num_kv_heads);
    for (uint32_t h = 0; h < shape_.num_kv_heads; ++h) {
      std::vector<int32_t> expected = {0, 1};
      expected.insert(expected.end(), (*top)[h].begin(), (*top)[h].end());
      EXPECT_EQ((*selection)[h], expected) << "layer " << layer << " head " << h;
      EXPECT_EQ((*selection)[h].size(), 6u);
    }
  }
}

TEST_F(CacheSelectorSelectTest, OracleTopKSelectsNothingForAPrefillChunk) {
  auto selection =
      Selector("oracle_topk").Select(OracleTopK(4, 2, 3), store_, prefill_, 0, 0, nullptr);
  ASSERT_TRUE(selection.ok()) << selection.status().ToString();
  EXPECT_EQ(*selection, KvHeadSelection(shape_.num_kv_heads));
}

TEST(CacheServiceSessions, OpenSessionRefusesAnUnknownSelectorOrABadParameter) {
  CacheService service(CacheServiceOptions{});
  SessionShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = 1;
  shape.num_query_heads = 1;
  shape.head_dim = 8;
  shape.capacity_tokens = 16;
  const Result<uint64_t> unknown = service.OpenSession(1, 1, shape, {.name = "topk2"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().message(),
            "cache rank: unknown selector 'topk2' (known: attention, oracle_topk, asyncspade)");
  const Result<uint64_t> bad = service.OpenSession(1, 1, shape, OracleTopK(0, 4, 256));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("top_k"), std::string::npos) << bad.status().message();
  EXPECT_EQ(service.Stats().store.sessions_open, 0u);
  EXPECT_TRUE(service.OpenSession(1, 1, shape, {}).ok());
  EXPECT_TRUE(service.OpenSession(1, 2, shape, OracleTopK(8, 4, 256)).ok());
  EXPECT_EQ(service.Stats().store.sessions_open, 2u);
}

// One peer cannot take the whole cache rank: past its byte budget or its session count its new
// session is refused by name, other peers still open theirs, and closing frees its share.
TEST(CacheServiceSessions, PerPeerLimitsRefuseOnlyThePeerPastThem) {
  SessionShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = 1;
  shape.num_query_heads = 1;
  shape.head_dim = 8;
  shape.capacity_tokens = 16;  // 2 * 16 * 8 * 4 = 1024 bytes a session
  CacheServiceOptions options;
  options.budget_bytes = 16 * 1024;
  options.peer_budget_bytes = 2 * 1024;
  options.max_sessions_per_peer = 3;
  CacheService service(options);
  const Result<uint64_t> first = service.OpenSession(1, 1, shape, {});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(service.OpenSession(1, 2, shape, {}).ok());
  const Result<uint64_t> over = service.OpenSession(1, 3, shape, {});
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("--peer-budget-mb"), std::string::npos)
      << over.status().message();
  EXPECT_TRUE(service.OpenSession(2, 4, shape, {}).ok()) << "another peer is not limited";
  ASSERT_TRUE(service.CloseSession(1, *first).ok());
  EXPECT_TRUE(service.OpenSession(1, 3, shape, {}).ok()) << "closing frees the peer's share";

  options.peer_budget_bytes = 0;  // the whole budget; the session count still applies
  CacheService counted(options);
  for (uint64_t request = 1; request <= 3; ++request) {
    ASSERT_TRUE(counted.OpenSession(7, request, shape, {}).ok());
  }
  const Result<uint64_t> fourth = counted.OpenSession(7, 4, shape, {});
  ASSERT_FALSE(fourth.ok());
  EXPECT_NE(fourth.status().message().find("--max-sessions-per-peer 3"), std::string::npos)
      << fourth.status().message();
  EXPECT_EQ(counted.Stats().store.sessions_open, 3u);
}

TEST(CacheServiceSessions, TheRpcOpenSessionTakesTheOldNameAndRefusesAnUnknownOne) {
  CacheService service(CacheServiceOptions{});
  CacheRpcHandler handler(service, nullptr);
  rpc::OpenSessionRequest request;
  request.set_request_id(1);
  request.set_num_layers(1);
  request.set_num_kv_heads(1);
  request.set_num_query_heads(1);
  request.set_head_dim(8);
  request.set_dtype("f32");
  request.set_capacity_tokens(16);
  request.set_selector("topk");
  request.set_top_k(8);
  request.set_sink_tokens(4);
  request.set_recent_tokens(256);
  EXPECT_TRUE(handler.OnOpenSession(/*connection=*/1, request).ok());
  request.set_request_id(2);
  request.set_selector("x");
  const Result<rpc::OpenSessionResponse> refused = handler.OnOpenSession(1, request);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "cache rank: unknown selector 'x' (known: attention, oracle_topk, asyncspade)");
  request.set_selector("oracle_topk");
  request.set_top_k(0);
  EXPECT_FALSE(handler.OnOpenSession(1, request).ok());
  EXPECT_EQ(service.Stats().store.sessions_open, 1u);
}

}  // namespace
}  // namespace rubato
