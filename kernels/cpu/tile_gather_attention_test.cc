// Tests for tile-sparse prefill attention (tile_gather_attention.h): against a double softmax over
// each query's tile list plus its own tile's causal part (chunks starting inside a tile, GQA 1/4/8,
// odd head_dim, empty lists), the full ascending lists against the dense rows path bit for bit,
// and refused input.
#include "kernels/cpu/tile_gather_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/kv_append.h"

namespace rubato {
namespace {

struct Case {
  int heads, kv_heads, head_dim, start, tokens, tile;
};

struct Sequence {
  Sequence(const Case& c, uint64_t seed) : c(c) {
    const int length = c.start + c.tokens;
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    keys.resize(size_t(length) * c.kv_heads * c.head_dim);
    values.resize(keys.size());
    for (float& x : keys) x = normal(rng);
    for (float& x : values) x = normal(rng);
    const int blocks = (length + 15) / 16;
    table.resize(blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    paged_keys.assign(size_t(blocks) * c.kv_heads * 16 * c.head_dim, NAN);
    paged_values.assign(paged_keys.size(), NAN);
    AppendToPagedKv(keys.data(), values.data(), length, 0, View());
    query.resize(size_t(c.tokens) * c.heads * c.head_dim);
    for (float& x : query) x = 1.5f * normal(rng);
  }
  PagedKvView View() {
    return {paged_keys.data(), paged_values.data(), table.data(), 16, c.kv_heads, c.head_dim};
  }
  double Key(int p, int h, int d) const {
    return keys[(size_t(p) * c.kv_heads + h) * c.head_dim + d];
  }
  double Value(int p, int h, int d) const {
    return values[(size_t(p) * c.kv_heads + h) * c.head_dim + d];
  }
  Case c;
  std::vector<float> keys, values, paged_keys, paged_values, query;
  std::vector<int32_t> table;
};

TEST(TileGatherAttention, MatchesDoubleReference) {
  const Case cases[] = {{2, 2, 24, 0, 70, 32},      // GQA 1, odd head_dim, from position 0
                        {8, 2, 64, 100, 90, 64},    // GQA 4, chunk starts inside a tile
                        {32, 4, 32, 257, 40, 128},  // GQA 8, one partial tile
                        {4, 1, 16, 33, 200, 16}};
  uint64_t seed = 1;
  for (const Case& c : cases) {
    Sequence s(c, seed++);
    std::mt19937 rng(seed++);
    const int tiles = TileGatherTiles(c.start, c.tokens, c.tile);
    std::vector<std::vector<int>> lists(size_t(tiles) * c.kv_heads);
    for (int t = 0; t < tiles; ++t) {
      const int tile_begin = (c.start / c.tile + t) * c.tile;
      for (int h = 0; h < c.kv_heads; ++h) {
        std::vector<int> all(tile_begin);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        all.resize(size_t((h == 1) ? 0 : tile_begin / (h + 2)));
        lists[size_t(t) * c.kv_heads + h] = all;
      }
    }
    std::vector<const int*> pointers;
    std::vector<int> counts;
    for (const auto& l : lists) {
      pointers.push_back(l.data());
      counts.push_back(int(l.size()));
    }
    std::vector<float> out(s.query.size(), NAN);
    TileGatherAttentionArgs args{s.query.data(), out.data(), c.tokens,        c.start,      c.heads,
                                 s.View(),       c.tile,     pointers.data(), counts.data()};
    std::vector<float> scratch(TileGatherAttentionScratchSize(args));
    ASSERT_TRUE(TileGatherAttention(args, scratch).ok());
    const int group = c.heads / c.kv_heads;
    for (int t = 0; t < c.tokens; ++t) {
      const int p = c.start + t;
      const int tile = p / c.tile - c.start / c.tile;
      for (int head = 0; head < c.heads; ++head) {
        const int h = head / group;
        std::vector<int> keys = lists[size_t(tile) * c.kv_heads + h];
        for (int j = p / c.tile * c.tile; j <= p; ++j) keys.push_back(j);
        const float* q = s.query.data() + (size_t(t) * c.heads + head) * c.head_dim;
        std::vector<double> w;
        for (int j : keys) {
          double dot = 0;
          for (int d = 0; d < c.head_dim; ++d) dot += q[d] * s.Key(j, h, d);
          w.push_back(dot / std::sqrt(double(c.head_dim)));
        }
        const double max = *std::max_element(w.begin(), w.end());
        double sum = 0;
        for (double& x : w) sum += (x = std::exp(x - max));
        for (int d = 0; d < c.head_dim; ++d) {
          double expect = 0;
          for (size_t i = 0; i < keys.size(); ++i) expect += w[i] / sum * s.Value(keys[i], h, d);
          ASSERT_NEAR(out[(size_t(t) * c.heads + head) * c.head_dim + d], expect, 2e-5)
              << "query " << t << " head " << head;
        }
      }
    }
  }
}

TEST(TileGatherAttention, FullListsAreTheDenseRowsPathBitForBit) {
  const Case c{8, 2, 64, 45, 150, 32};
  Sequence s(c, 7);
  const int tiles = TileGatherTiles(c.start, c.tokens, c.tile);
  std::vector<std::vector<int>> lists;
  std::vector<const int*> pointers;
  std::vector<int> counts;
  for (int t = 0; t < tiles; ++t) {
    for (int h = 0; h < c.kv_heads; ++h) {
      std::vector<int> all((c.start / c.tile + t) * c.tile);
      std::iota(all.begin(), all.end(), 0);
      lists.push_back(all);
    }
  }
  for (const auto& l : lists) {
    pointers.push_back(l.data());
    counts.push_back(int(l.size()));
  }
  std::vector<float> out(s.query.size(), NAN), dense(s.query.size(), NAN);
  TileGatherAttentionArgs args{s.query.data(), out.data(), c.tokens,        c.start,      c.heads,
                               s.View(),       c.tile,     pointers.data(), counts.data()};
  std::vector<float> scratch(TileGatherAttentionScratchSize(args));
  ASSERT_TRUE(TileGatherAttention(args, scratch).ok());
  const CausalAttentionArgs rows{s.query.data(), dense.data(), c.tokens, c.start,
                                 c.heads,        s.View(),     {}};
  std::vector<float> rows_scratch(size_t(RowsAttentionScratchSize(rows)));
  for (int h = 0; h < c.kv_heads; ++h) RowsAttentionForKvHead(rows, h, rows_scratch.data());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], dense[i]) << i;
}

TEST(TileGatherAttention, RefusesListsReachingIntoTheirTile) {
  const Case c{4, 2, 16, 40, 30, 32};  // tiles [32, 64) and [64, 96)
  Sequence s(c, 3);
  std::vector<int> ok = {1, 5}, late = {1, 33}, twice = {2, 2};
  std::vector<float> out(s.query.size()), scratch(256);
  auto run = [&](const std::vector<int>& second) {
    std::vector<const int*> pointers = {ok.data(), second.data(), ok.data(), ok.data()};
    std::vector<int> counts = {2, int(second.size()), 2, 2};
    TileGatherAttentionArgs args{s.query.data(), out.data(), c.tokens,        c.start,      c.heads,
                                 s.View(),       c.tile,     pointers.data(), counts.data()};
    return TileGatherAttention(args, scratch).message();
  };
  EXPECT_EQ(run(ok), "");
  EXPECT_NE(run(late).find("tile 0, KV head 1: position 33 is not before the tile (32)"),
            std::string::npos)
      << run(late);
  EXPECT_NE(run(twice).find("position 2 twice"), std::string::npos);
  EXPECT_EQ(TileGatherTiles(40, 30, 32), 2);
  EXPECT_EQ(TileGatherTiles(64, 1, 32), 1);
}

}  // namespace
}  // namespace rubato
