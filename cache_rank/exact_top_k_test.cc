// Tests for the exact GQA-pooled top-k: against a brute-force double-precision implementation
// on random data (GQA groups 1 / 2 / 4, f32 and bf16 keys, k below / equal to / above the
// range, sub-ranges, duplicated key rows for ties), all-equal keys, non-finite keys, and the
// refused arguments.
#include "cache_rank/exact_top_k.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cache_rank/store_test_util.h"

namespace rubato {
namespace {

using cache_rank_test::BuildKvPack;

// The keys of one layer as the store holds them, in fp32: [kv_head][tokens][head_dim].
struct LayerKeys {
  std::vector<float> values;
  uint32_t tokens = 0;
};

// Fills a store session with `tokens` random keys per (layer, KV head) in one prefill pack;
// rows j and j + 5 are equal for every j % 7 == 3 (ties). Returns the stored keys (after the
// dtype round trip) per layer.
std::vector<LayerKeys> FillRandom(KvStore& store, uint64_t session, const SessionShape& shape,
                                  uint32_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<LayerKeys> keys(shape.num_layers);
  for (LayerKeys& layer : keys) {
    layer.tokens = tokens;
    layer.values.resize(size_t{shape.num_kv_heads} * tokens * shape.head_dim);
    for (float& v : layer.values) v = 2.0f * normal(rng);
    for (uint32_t h = 0; h < shape.num_kv_heads; ++h) {
      for (uint32_t j = 3; j + 5 < tokens; j += 7) {
        float* base = layer.values.data() + size_t{h} * tokens * shape.head_dim;
        std::copy(base + size_t{j} * shape.head_dim, base + size_t{j + 1} * shape.head_dim,
                  base + size_t{j + 5} * shape.head_dim);
      }
    }
    // What the store will hold: values rounded to the session dtype.
    std::vector<std::byte> stored(layer.values.size() * DTypeSize(shape.dtype));
    ConvertFromF32(shape.dtype, layer.values.data(), stored.data(), layer.values.size());
    ConvertToF32(shape.dtype, stored.data(), layer.values.data(), layer.values.size());
  }
  auto fill = [&](uint32_t, uint32_t layer, int kv, uint32_t head, uint32_t position,
                  std::span<std::byte> row) {
    const float* src = keys[layer].values.data() +
                       (size_t{head} * tokens + position) * shape.head_dim;
    std::vector<float> zeros(shape.head_dim, 0.0f);
    ConvertFromF32(shape.dtype, kv == 0 ? src : zeros.data(), row.data(), shape.head_dim);
  };
  auto pack = BuildKvPack(shape, 1, 0, shape.num_layers, {{session, 0, tokens, 1}}, fill);
  const Status status = store.AppendKvPack(pack.view);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return keys;
}

// Pooled score per position of [begin, end) for KV head g, in double precision.
std::vector<double> BruteForceScores(const LayerKeys& keys, const SessionShape& shape,
                                     const std::vector<float>& query, uint32_t g,
                                     uint32_t begin, uint32_t end) {
  const uint32_t group = shape.num_query_heads / shape.num_kv_heads;
  std::vector<double> pooled(end - begin, 0.0);
  for (uint32_t q = g * group; q < (g + 1) * group; ++q) {
    std::vector<double> logits;
    for (uint32_t j = begin; j < end; ++j) {
      double dot = 0.0;
      for (uint32_t d = 0; d < shape.head_dim; ++d) {
        dot += double{query[size_t{q} * shape.head_dim + d]} *
               double{keys.values[(size_t{g} * keys.tokens + j) * shape.head_dim + d]};
      }
      logits.push_back(dot / std::sqrt(static_cast<double>(shape.head_dim)));
    }
    const double max_logit = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (double& l : logits) sum += (l = std::exp(l - max_logit));
    for (size_t j = 0; j < logits.size(); ++j) pooled[j] += logits[j] / sum / group;
  }
  return pooled;
}

// The selection must be min(k, n) ascending positions in range, and no unselected position may
// beat a selected one: by more than f32 rounding, or on an exact tie with a lower position.
void ExpectTopK(const std::vector<int32_t>& chosen, const std::vector<double>& scores,
                uint32_t begin, uint32_t k, const std::string& where) {
  const size_t n = scores.size();
  ASSERT_EQ(chosen.size(), std::min<size_t>(k, n)) << where;
  ASSERT_TRUE(std::is_sorted(chosen.begin(), chosen.end())) << where;
  std::set<int32_t> selected(chosen.begin(), chosen.end());
  ASSERT_EQ(selected.size(), chosen.size()) << where << ": repeated positions";
  const double tolerance = 1e-6 * *std::max_element(scores.begin(), scores.end());
  for (int32_t s : chosen) {
    ASSERT_GE(s, static_cast<int32_t>(begin)) << where;
    ASSERT_LT(s, static_cast<int32_t>(begin + n)) << where;
  }
  for (size_t u = 0; u < n; ++u) {
    const int32_t unselected = static_cast<int32_t>(begin + u);
    if (selected.count(unselected)) continue;
    for (int32_t s : chosen) {
      const double score_s = scores[s - begin];
      ASSERT_LE(scores[u], score_s + tolerance)
          << where << ": position " << unselected << " (score " << scores[u]
          << ") beats selected " << s << " (score " << score_s << ")";
      if (scores[u] == score_s) {
        ASSERT_GT(unselected, s) << where << ": tie lost by the lower position " << unselected;
      }
    }
  }
}

// GQA group size, dtype.
class ExactTopKRandom : public ::testing::TestWithParam<std::tuple<uint32_t, DType>> {};

TEST_P(ExactTopKRandom, MatchesBruteForce) {
  const auto [group, dtype] = GetParam();
  SessionShape shape;
  shape.num_layers = 2;
  shape.num_kv_heads = 2;
  shape.num_query_heads = 2 * group;
  shape.head_dim = 16;
  shape.dtype = dtype;
  shape.capacity_tokens = 128;
  KvStore store({.budget_bytes = 1 << 22, .allocator = nullptr});
  const uint64_t session = *store.OpenSession(1, shape);
  const uint32_t tokens = 97;
  const auto keys = FillRandom(store, session, shape, tokens, 11 + group);
  std::mt19937 rng(5 + group);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int checked = 0;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    std::vector<float> query(size_t{shape.num_query_heads} * shape.head_dim);
    for (float& q : query) q = normal(rng);
    for (const auto& [begin, end] : {std::pair{0u, tokens}, std::pair{5u, 40u}}) {
      const uint32_t n = end - begin;
      for (uint32_t k : {1u, 7u, n - 1, n, n + 10}) {
        auto top = ExactTopK(store, session, layer, query, k, begin, end);
        ASSERT_TRUE(top.ok()) << top.status().ToString();
        ASSERT_EQ(top->size(), shape.num_kv_heads);
        for (uint32_t g = 0; g < shape.num_kv_heads; ++g) {
          const std::string where = "group " + std::to_string(group) + " layer " +
                                    std::to_string(layer) + " range [" +
                                    std::to_string(begin) + ", " + std::to_string(end) +
                                    ") k " + std::to_string(k) + " kv head " + std::to_string(g);
          ExpectTopK((*top)[g], BruteForceScores(keys[layer], shape, query, g, begin, end),
                     begin, k, where);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 2 * 5 * 2);
}

INSTANTIATE_TEST_SUITE_P(Groups, ExactTopKRandom,
                         ::testing::Combine(::testing::Values(1u, 2u, 4u),
                                            ::testing::Values(DType::kF32, DType::kBF16)));

SessionShape TinyShape() {
  SessionShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = 1;
  shape.num_query_heads = 2;
  shape.head_dim = 4;
  shape.dtype = DType::kF32;
  shape.capacity_tokens = 16;
  return shape;
}

TEST(ExactTopK, EqualKeysGoToLowerPositions) {
  const SessionShape shape = TinyShape();
  KvStore store({.budget_bytes = 1 << 20, .allocator = nullptr});
  const uint64_t s = *store.OpenSession(1, shape);
  auto fill = [&](uint32_t, uint32_t, int, uint32_t, uint32_t, std::span<std::byte> row) {
    const std::vector<float> ones(shape.head_dim, 1.0f);
    ConvertFromF32(shape.dtype, ones.data(), row.data(), shape.head_dim);
  };
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 1, 0, 1, {{s, 0, 12, 1}}, fill).view).ok());
  const std::vector<float> query(8, 0.5f);
  auto top = ExactTopK(store, s, 0, query, 4, 3, 12);
  ASSERT_TRUE(top.ok());
  EXPECT_EQ((*top)[0], (std::vector<int32_t>{3, 4, 5, 6}));
  auto none = ExactTopK(store, s, 0, query, 0, 3, 12);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE((*none)[0].empty());
  auto empty_range = ExactTopK(store, s, 0, query, 4, 7, 7);
  ASSERT_TRUE(empty_range.ok());
  EXPECT_TRUE((*empty_range)[0].empty());
}

TEST(ExactTopK, NonFiniteKeysRankLast) {
  const SessionShape shape = TinyShape();
  KvStore store({.budget_bytes = 1 << 20, .allocator = nullptr});
  const uint64_t s = *store.OpenSession(1, shape);
  // Key j = (j, j, j, j) except NaN at 9 and inf at 10: the largest finite keys are 11, 8, 7.
  auto fill = [&](uint32_t, uint32_t, int, uint32_t, uint32_t position,
                  std::span<std::byte> row) {
    float v = static_cast<float>(position);
    if (position == 9) v = std::numeric_limits<float>::quiet_NaN();
    if (position == 10) v = std::numeric_limits<float>::infinity();
    const std::vector<float> values(shape.head_dim, v);
    ConvertFromF32(shape.dtype, values.data(), row.data(), shape.head_dim);
  };
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 1, 0, 1, {{s, 0, 12, 1}}, fill).view).ok());
  const std::vector<float> query(8, 0.25f);
  auto top = ExactTopK(store, s, 0, query, 3, 0, 12);
  ASSERT_TRUE(top.ok());
  EXPECT_EQ((*top)[0], (std::vector<int32_t>{7, 8, 11}));
}

TEST(ExactTopK, RefusesBadArguments) {
  const SessionShape shape = TinyShape();
  KvStore store({.budget_bytes = 1 << 20, .allocator = nullptr});
  const uint64_t s = *store.OpenSession(1, shape);
  ASSERT_TRUE(store.AppendKvPack(BuildKvPack(shape, 1, 0, 1, {{s, 0, 6, 1}}).view).ok());
  std::vector<float> query(8, 1.0f);
  auto expect = [&](Result<KvHeadSelection> result, const std::string& text) {
    ASSERT_FALSE(result.ok()) << text;
    EXPECT_NE(result.status().message().find(text), std::string::npos)
        << result.status().ToString();
  };
  expect(ExactTopK(store, s, 0, query, 2, 0, 7), "range [0, 7) is not within the 6 readable");
  expect(ExactTopK(store, s, 0, query, 2, 4, 3), "range [4, 3)");
  expect(ExactTopK(store, s, 1, query, 2, 0, 6), "layer 1 is not below num_layers 1");
  expect(ExactTopK(store, s + 1, 0, query, 2, 0, 6), "is not open");
  expect(ExactTopK(store, s, 0, std::span(query).first(7), 2, 0, 6),
         "query has 7 values, expected num_query_heads 2 x head_dim 4 = 8");
  query[5] = std::numeric_limits<float>::quiet_NaN();
  expect(ExactTopK(store, s, 0, query, 2, 0, 6), "query[5] = nan is not finite");
}

}  // namespace
}  // namespace rubato
