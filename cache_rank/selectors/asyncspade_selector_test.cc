// The `asyncspade` cache selector against the store: the ranges of the next token, its
// refusals by field name, a prompt then decode steps whose queries repeat (the predicted
// selection equals the exact top-k of the real query, and the counters say cosine 1 and overlap
// 1), and the counters of changing queries.
#include "cache_rank/selectors/asyncspade_selector.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache_rank/exact_top_k.h"
#include "cache_rank/kv_store.h"

namespace rubato {
namespace {

CacheSelectorSpec Spec(int top_k, int sink, int recent, int window) {
  CacheSelectorSpec spec;
  spec.name = "asyncspade";
  spec.top_k = top_k;
  spec.sink_tokens = sink;
  spec.recent_tokens = recent;
  spec.query_window = window;
  spec.overlap_every = 1;
  return spec;
}

TEST(AsyncSpadeSelector, IsRegisteredAndServesTheNextStep) {
  const CacheSelector* selector = FindCacheSelector("asyncspade");
  ASSERT_EQ(selector, &kAsyncSpadeCacheSelector);
  EXPECT_TRUE(selector->traits().needs_query);
  EXPECT_FALSE(selector->traits().serves_same_step);
  EXPECT_FALSE(selector->traits().partial_attention);
  const CacheSelectorSpec spec = Spec(8, 2, 4, 16);
  // After a 40-token prompt the next token (position 40) attends [0, 41): recent [37, 41).
  EXPECT_EQ(selector->ReplyRangeFor(spec, 0, 40), (ReplyRange{2, 37, 10, 0}));
  EXPECT_EQ(selector->ReplyRangeFor(spec, 40, 1), (ReplyRange{2, 38, 10, 0}));
  // Short contexts: everything before the recent window, then nothing.
  EXPECT_EQ(selector->ReplyRangeFor(spec, 0, 9), (ReplyRange{2, 6, 6, 0}));
  EXPECT_EQ(selector->ReplyRangeFor(spec, 0, 2), (ReplyRange{0, 0, 0, 0}));
}

TEST(AsyncSpadeSelector, RefusesBadParametersByName) {
  std::vector<std::pair<std::string, CacheSelectorSpec>> cases;
  const auto add = [&](const char* field, auto change) {
    CacheSelectorSpec spec = Spec(8, 2, 4, 16);
    change(spec);
    cases.emplace_back(field, spec);
  };
  add("top_k", [](CacheSelectorSpec& s) { s.top_k = 0; });
  add("sink_tokens", [](CacheSelectorSpec& s) { s.sink_tokens = -1; });
  add("recent_tokens", [](CacheSelectorSpec& s) { s.recent_tokens = 0; });
  add("query_window", [](CacheSelectorSpec& s) { s.query_window = 0; });
  add("query_window", [](CacheSelectorSpec& s) { s.query_window = 65; });
  add("ridge_lambda", [](CacheSelectorSpec& s) { s.ridge_lambda = 0; });
  add("ridge_lambda", [](CacheSelectorSpec& s) { s.ridge_lambda = NAN; });
  add("dense_steps", [](CacheSelectorSpec& s) { s.dense_steps = -1; });
  add("overlap_every", [](CacheSelectorSpec& s) { s.overlap_every = -2; });
  for (const auto& [field, spec] : cases) {
    const Result<const CacheSelector*> resolved = ResolveCacheSelector(spec);
    ASSERT_FALSE(resolved.ok()) << field;
    EXPECT_NE(resolved.status().message().find("selector asyncspade: " + field), std::string::npos)
        << resolved.status().message();
  }
  EXPECT_TRUE(ResolveCacheSelector(Spec(8, 2, 4, 16)).ok());
}

// A session of random keys fed a prompt and decode steps, each pack with a given query.
class AsyncSpadeSessionTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kLayers = 2, kKvHeads = 2, kHeads = 4, kDim = 16;

  void SetUp() override {
    const uint32_t seed = std::random_device{}();
    std::printf("seed %u\n", seed);
    rng_.seed(seed);
    shape_ = SessionShape{kLayers, kKvHeads, kHeads, kDim, DType::kF32, 128};
    auto session = store_.OpenSession(1, shape_);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    session_ = *session;
    state_ = kAsyncSpadeCacheSelector.NewState(spec_, shape_);
  }

  std::vector<float> RandomQuery() {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> query(kHeads * kDim);
    for (float& x : query) x = normal(rng_);
    return query;
  }

  // Appends positions [first, first + tokens) of random K / V with `query` as every layer's;
  // `buffer` keeps the pack's bytes.
  LayerPackView Append(uint32_t first, uint32_t tokens, const std::vector<float>& query,
                       std::vector<std::byte>& buffer) {
    LayerPackShape shape{.kind = LayerPackKind::kKvPack,
                         .step = ++step_,
                         .first_layer = 0,
                         .num_layers = kLayers,
                         .dtype = DType::kF32,
                         .num_kv_heads = kKvHeads,
                         .num_query_heads = kHeads,
                         .head_dim = kDim,
                         .has_query = true};
    LayerPackRequest request;
    request.session_id = session_;
    request.first_position = first;
    request.new_tokens = tokens;
    request.reply_slots = static_cast<uint32_t>(
        kAsyncSpadeCacheSelector.ReplyRangeFor(spec_, int(first), int(tokens)).slots);
    const std::vector<LayerPackRequest> requests{request};
    auto bytes = KvPackBytes(shape, requests);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    buffer.assign(*bytes, std::byte{0});
    auto writer = LayerPackWriter::Create(shape, requests, buffer);
    EXPECT_TRUE(writer.ok()) << writer.status().ToString();
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (std::span<std::byte> section : {writer->Key(l, 0), writer->Value(l, 0)}) {
        std::vector<float> rows(section.size() / sizeof(float));
        for (float& x : rows) x = normal(rng_);
        std::memcpy(section.data(), rows.data(), section.size());
      }
      std::memcpy(writer->Query(l, 0).data(), query.data(), query.size() * sizeof(float));
    }
    auto view = LayerPackView::Parse(buffer);
    EXPECT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_TRUE(store_.AppendKvPack(*view).ok());
    return *view;
  }

  // Append, then the selection of every layer (the replies'), [layer].
  std::vector<KvHeadSelection> Step(uint32_t first, uint32_t tokens,
                                    const std::vector<float>& query) {
    std::vector<std::byte> buffer;
    const LayerPackView view = Append(first, tokens, query, buffer);
    std::vector<KvHeadSelection> selections;
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto selection = kAsyncSpadeCacheSelector.Select(spec_, store_, view, l, 0, state_.get());
      EXPECT_TRUE(selection.ok()) << selection.status().ToString();
      selections.push_back(selection.ok() ? *selection : KvHeadSelection{});
    }
    return selections;
  }

  // The sink, then the exact top-k of the next token's candidates by `query`, per layer.
  std::vector<KvHeadSelection> Exact(uint32_t first, uint32_t tokens,
                                     const std::vector<float>& query) {
    const ReplyRange range = kAsyncSpadeCacheSelector.ReplyRangeFor(spec_, int(first), int(tokens));
    std::vector<KvHeadSelection> want;
    for (uint32_t l = 0; l < kLayers; ++l) {
      auto top = ExactTopK(store_, session_, l, query, uint32_t(spec_.top_k),
                           uint32_t(range.sink_end), uint32_t(range.recent_begin));
      EXPECT_TRUE(top.ok()) << top.status().ToString();
      KvHeadSelection heads(kKvHeads);
      for (uint32_t g = 0; g < kKvHeads; ++g) {
        for (int j = 0; j < range.sink_end; ++j) heads[g].push_back(j);
        heads[g].insert(heads[g].end(), (*top)[g].begin(), (*top)[g].end());
      }
      want.push_back(heads);
    }
    return want;
  }

  CacheSelectorSpec spec_ = Spec(8, 2, 4, 4);
  KvStore store_{KvStoreOptions{uint64_t{16} << 20, nullptr}};
  SessionShape shape_;
  uint64_t session_ = 0;
  std::unique_ptr<CacheSelectorState> state_;
  std::mt19937 rng_;
  uint64_t step_ = 0;
};

TEST_F(AsyncSpadeSessionTest, RepeatingQueriesSelectTheExactTopKOfTheRealQuery) {
  const std::vector<float> query = RandomQuery();
  const auto first = Step(0, 40, query);  // one query: repeated as it is
  EXPECT_EQ(first, Exact(0, 40, query));
  for (uint32_t position = 40; position < 48; ++position) {
    SCOPED_TRACE("position " + std::to_string(position));
    const auto selected = Step(position, 1, query);  // appends first
    EXPECT_EQ(selected, Exact(position, 1, query));
  }
  const PredictionCounters& counters = state_->counters;
  EXPECT_EQ(counters.cosine_count, 8u * kLayers * kHeads);
  EXPECT_NEAR(counters.cosine_sum / double(counters.cosine_count), 1.0, 1e-6);
  EXPECT_EQ(counters.overlap_total, 8u * kLayers * kKvHeads * spec_.top_k);
  EXPECT_EQ(counters.overlap_hits, counters.overlap_total);
}

TEST_F(AsyncSpadeSessionTest, ChangingQueriesAreCountedAndAPromptRestartsTheWindows) {
  Step(0, 30, RandomQuery());
  for (uint32_t position = 30; position < 36; ++position) Step(position, 1, RandomQuery());
  const PredictionCounters after = state_->counters;
  EXPECT_EQ(after.cosine_count, 6u * kLayers * kHeads);
  EXPECT_LT(after.cosine_sum / double(after.cosine_count), 0.9);  // independent random queries
  EXPECT_LE(after.overlap_hits, after.overlap_total);
  // A second prompt chunk: the windows start from its query, which is repeated as it is.
  const std::vector<float> query = RandomQuery();
  const auto selected = Step(36, 20, query);
  EXPECT_EQ(selected, Exact(36, 20, query));
  EXPECT_EQ(state_->counters.cosine_count, after.cosine_count);  // a chunk is not compared
}

TEST_F(AsyncSpadeSessionTest, SelectWithoutStateIsRefused) {
  std::vector<std::byte> buffer;
  const LayerPackView view = Append(0, 10, RandomQuery(), buffer);
  const auto selection = kAsyncSpadeCacheSelector.Select(spec_, store_, view, 0, 0, nullptr);
  ASSERT_FALSE(selection.ok());
  EXPECT_EQ(selection.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(selection.status().message().find("no query window state"), std::string::npos);
}

}  // namespace
}  // namespace rubato
