// Kascade's prefill modes of kernels/cuda/prefill_attention (PrefillMode kLse, kPool, kList) and
// PooledTopK's pooled input, on fresh random bf16 Q/K/V in shuffled paged pools: kList over
// every earlier position equals kDense bit for bit; kList over random lists (any order, a head
// map, a partial last list tile) against the CPU twin TileGatherAttention; the lse of kLse and of
// kDense against a double reference (and each other, bitwise); kPool's per-tile sums against a
// double reference; the pooled top-k against a sort; and the launcher naming bad mode fields.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/tile_gather_attention.h"
#include "kernels/cuda/pooled_top_k.cuh"
#include "kernels/cuda/prefill_attention.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using cuda::PrefillMode;
using gpu_test::Bf16Close;
using gpu_test::Download;
using gpu_test::FromBf16;
using gpu_test::RandomBf16Values;
using gpu_test::ToBf16;
using gpu_test::Upload;

constexpr int kTile = 128;

// One entry's chunk: rows [start, start + tokens) of a sequence holding start + tokens keys.
struct TileCase {
  int head_dim = 64, group = 4, kv_heads = 2, block_tokens = 16;
  int start = 0, tokens = 0;
  int num_heads() const { return kv_heads * group; }
  int end() const { return start + tokens; }
  int tiles() const { return TileGatherTiles(start, tokens, kTile); }
  int tile_begin(int t) const { return (start / kTile + t) * kTile; }

  std::vector<int32_t> table;
  std::vector<float> keys, values, queries;  // pools (f32 copies of bf16), [tokens][heads][dim]
  cuda::DeviceBuffer<__nv_bfloat16> q, key_pool, value_pool;
  cuda::DeviceBuffer<int32_t> d_table, d_query_start, d_start, d_tile_base;

  void Build(std::mt19937_64& rng) {
    const int blocks = (end() + block_tokens - 1) / block_tokens;
    table.resize(static_cast<size_t>(blocks));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    keys = RandomBf16Values(rng, size_t(blocks) * kv_heads * block_tokens * head_dim);
    values = RandomBf16Values(rng, keys.size());
    queries = RandomBf16Values(rng, size_t(tokens) * num_heads() * head_dim, -2.f, 2.f);
    q = Upload(ToBf16(queries));
    key_pool = Upload(ToBf16(keys));
    value_pool = Upload(ToBf16(values));
    d_table = Upload(table);
    d_query_start = Upload(std::vector<int32_t>{0, tokens});
    d_start = Upload(std::vector<int32_t>{start});
    d_tile_base = Upload(std::vector<int32_t>{0});
  }
  PagedKvView View() {
    return PagedKvView{keys.data(), values.data(), table.data(), block_tokens, kv_heads, head_dim};
  }
  cuda::PrefillAttentionParams Params(PrefillMode mode) const {
    cuda::PrefillAttentionParams p;
    p.q = q.data();
    p.q_row_stride = int64_t(num_heads()) * head_dim;
    p.key_pool = key_pool.data();
    p.value_pool = value_pool.data();
    p.block_tables = d_table.data();
    p.block_table_stride = static_cast<int>(table.size());
    p.query_start = d_query_start.data();
    p.start_position = d_start.data();
    p.entries = 1;
    p.total_tokens = tokens;
    p.max_query_tokens = tokens;
    p.num_heads = num_heads();
    p.num_kv_heads = kv_heads;
    p.head_dim = head_dim;
    p.block_tokens = block_tokens;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    p.out_row_stride = int64_t(num_heads()) * head_dim;
    p.mode = mode;
    p.tile_tokens = kTile;
    p.tile_base = d_tile_base.data();
    return p;
  }
  // Double reference: row (t, h)'s scaled scores over keys [0, start + t].
  std::vector<double> Scores(int t, int h) {
    const PagedKvView kv = View();
    const float* query = queries.data() + (size_t(t) * num_heads() + h) * head_dim;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    std::vector<double> s(static_cast<size_t>(start + t + 1));
    for (size_t j = 0; j < s.size(); ++j) {
      const float* key = kv.keys + kv.Offset(static_cast<int>(j), h / group);
      double dot = 0;
      for (int d = 0; d < head_dim; ++d) dot += double(query[d]) * key[d];
      s[j] = dot * scale;
    }
    return s;
  }
  static double Lse(const std::vector<double>& s) {
    const double max = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double v : s) sum += std::exp(v - max);
    return max + std::log(sum);
  }
};

std::vector<float> RunOut(const TileCase& setup, cuda::PrefillAttentionParams p) {
  auto out =
      gpu_test::Poisoned<__nv_bfloat16>(size_t(setup.tokens) * setup.num_heads() * setup.head_dim);
  p.out = out.data();
  const Status status = cuda::PrefillAttention(p, nullptr);
  EXPECT_TRUE(status.ok()) << status.message();
  return FromBf16(Download(out));
}

// Shapes: a chunk starting mid-tile and mid-block, reaching into a third tile.
std::vector<TileCase> Shapes() {
  std::vector<TileCase> shapes;
  for (int head_dim : {64, 128}) {
    for (int group : {1, 2, 4, 8}) {
      TileCase s;
      s.head_dim = head_dim;
      s.group = group;
      s.start = 200;
      s.tokens = 190;
      shapes.push_back(std::move(s));
    }
  }
  return shapes;
}

TEST(PrefillTilesOpTest, ListOfEveryEarlierPositionEqualsDenseBitwise) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<TileCase> shapes = Shapes();
  for (TileCase& s : shapes) {
    SCOPED_TRACE("head_dim " + std::to_string(s.head_dim) + " group " + std::to_string(s.group));
    s.Build(rng);
    const int capacity = s.tile_begin(s.tiles() - 1);
    std::vector<int32_t> lists(size_t(s.tiles()) * s.kv_heads * capacity, -1);
    std::vector<int32_t> counts(size_t(s.tiles()) * s.kv_heads);
    for (int t = 0; t < s.tiles(); ++t) {
      for (int h = 0; h < s.kv_heads; ++h) {
        counts[size_t(t) * s.kv_heads + h] = s.tile_begin(t);
        std::iota(lists.begin() + (size_t(t) * s.kv_heads + h) * capacity,
                  lists.begin() + (size_t(t) * s.kv_heads + h) * capacity + s.tile_begin(t), 0);
      }
    }
    auto d_lists = Upload(lists);
    auto d_counts = Upload(counts);
    cuda::PrefillAttentionParams list = s.Params(PrefillMode::kList);
    list.lists = d_lists.data();
    list.list_counts = d_counts.data();
    list.list_capacity = capacity;
    list.list_heads = s.kv_heads;
    const std::vector<float> dense = RunOut(s, s.Params(PrefillMode::kDense));
    const std::vector<float> sparse = RunOut(s, list);
    ASSERT_EQ(std::memcmp(dense.data(), sparse.data(), dense.size() * sizeof(float)), 0);
    // An entry outside the selection (tile_base -1) is attended densely by kList too.
    auto outside = Upload(std::vector<int32_t>{-1});
    list.tile_base = outside.data();
    const std::vector<float> unselected = RunOut(s, list);
    ASSERT_EQ(std::memcmp(dense.data(), unselected.data(), dense.size() * sizeof(float)), 0);
  }
}

TEST(PrefillTilesOpTest, RandomListsMatchTileGatherAttention) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<TileCase> shapes = Shapes();
  for (TileCase& s : shapes) {
    SCOPED_TRACE("head_dim " + std::to_string(s.head_dim) + " group " + std::to_string(s.group));
    s.Build(rng);
    // Lists of a third of the earlier positions (at least 70: a partial last list tile), shuffled,
    // for list_heads = kv_heads; KV head h reads list head (h + 1) % kv_heads.
    const int capacity = s.tile_begin(s.tiles() - 1);
    std::vector<int32_t> lists(size_t(s.tiles()) * s.kv_heads * capacity, -1);
    std::vector<int32_t> counts(size_t(s.tiles()) * s.kv_heads);
    std::vector<std::vector<int>> cpu_lists(counts.size());
    for (int t = 0; t < s.tiles(); ++t) {
      for (int m = 0; m < s.kv_heads; ++m) {
        std::vector<int> all(static_cast<size_t>(s.tile_begin(t)));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        all.resize(std::min<size_t>(all.size(), std::max<size_t>(70, all.size() / 3)));
        const size_t at = size_t(t) * s.kv_heads + m;
        counts[at] = static_cast<int32_t>(all.size());
        std::copy(all.begin(), all.end(), lists.begin() + at * capacity);
        cpu_lists[at] = all;
      }
    }
    std::vector<int32_t> head_map(static_cast<size_t>(s.kv_heads));
    for (int h = 0; h < s.kv_heads; ++h) head_map[h] = (h + 1) % s.kv_heads;
    auto d_lists = Upload(lists);
    auto d_counts = Upload(counts);
    auto d_map = Upload(head_map);
    cuda::PrefillAttentionParams list = s.Params(PrefillMode::kList);
    list.lists = d_lists.data();
    list.list_counts = d_counts.data();
    list.list_capacity = capacity;
    list.list_heads = s.kv_heads;
    list.head_map = d_map.data();
    const std::vector<float> actual = RunOut(s, list);

    std::vector<const int*> pointers(counts.size());
    std::vector<int> cpu_counts(counts.size());
    for (int t = 0; t < s.tiles(); ++t) {
      for (int h = 0; h < s.kv_heads; ++h) {
        const size_t from = size_t(t) * s.kv_heads + head_map[h];
        pointers[size_t(t) * s.kv_heads + h] = cpu_lists[from].data();
        cpu_counts[size_t(t) * s.kv_heads + h] = counts[from];
      }
    }
    TileGatherAttentionArgs args;
    std::vector<float> expected(actual.size());
    args.query = s.queries.data();
    args.output = expected.data();
    args.tokens = s.tokens;
    args.start_position = s.start;
    args.num_heads = s.num_heads();
    args.kv = s.View();
    args.tile_tokens = kTile;
    args.lists = pointers.data();
    args.counts = cpu_counts.data();
    std::vector<float> scratch(static_cast<size_t>(TileGatherAttentionScratchSize(args)));
    ASSERT_STATUS_OK(TileGatherAttention(args, scratch));
    EXPECT_TRUE(Bf16Close("tile-gather prefill", actual, expected, 5e-3, 1e-2));
  }
}

TEST(PrefillTilesOpTest, LseAndPooledProbabilitiesMatchDoubleReference) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  std::vector<TileCase> shapes = Shapes();
  for (TileCase& s : shapes) {
    SCOPED_TRACE("head_dim " + std::to_string(s.head_dim) + " group " + std::to_string(s.group));
    s.Build(rng);
    const size_t rows = size_t(s.tokens) * s.num_heads();
    auto lse = gpu_test::Poisoned<float>(rows);
    auto dense_lse = gpu_test::Poisoned<float>(rows);
    cuda::PrefillAttentionParams pass = s.Params(PrefillMode::kLse);
    pass.lse = lse.data();
    ASSERT_STATUS_OK(cuda::PrefillAttention(pass, nullptr));
    cuda::PrefillAttentionParams dense = s.Params(PrefillMode::kDense);
    dense.lse = dense_lse.data();
    RunOut(s, dense);
    const std::vector<float> got = Download(lse);
    ASSERT_EQ(std::memcmp(got.data(), Download(dense_lse).data(), rows * sizeof(float)), 0)
        << "kLse and kDense disagree on the lse";

    const int64_t stride = s.tile_begin(s.tiles() - 1);
    const size_t pooled_size = size_t(s.tiles()) * s.kv_heads * stride;
    auto pooled = Upload(std::vector<float>(pooled_size, 0.f));
    cuda::PrefillAttentionParams pool = s.Params(PrefillMode::kPool);
    pool.lse = lse.data();
    pool.pooled = pooled.data();
    pool.pooled_stride = stride;
    ASSERT_STATUS_OK(cuda::PrefillAttention(pool, nullptr));
    const std::vector<float> pooled_got = Download(pooled);

    std::vector<double> pooled_ref(pooled_size, 0.0);
    double worst_lse = 0;
    for (int t = 0; t < s.tokens; ++t) {
      const int position = s.start + t;
      const int tile = position / kTile - s.start / kTile;
      for (int h = 0; h < s.num_heads(); ++h) {
        const std::vector<double> scores = s.Scores(t, h);
        const double ref = TileCase::Lse(scores);
        worst_lse = std::max(worst_lse, std::fabs(got[size_t(t) * s.num_heads() + h] - ref));
        for (int j = 0; j < position / kTile * kTile; ++j) {
          pooled_ref[(size_t(tile) * s.kv_heads + h / s.group) * stride + j] +=
              std::exp(scores[j] - ref);
        }
      }
    }
    // bf16 inputs, fp32 scores: |lse error| well under 1e-3 for O(1) scores.
    EXPECT_LT(worst_lse, 2e-3);
    for (size_t i = 0; i < pooled_size; ++i) {
      ASSERT_NEAR(pooled_got[i], pooled_ref[i], 1e-5 + 5e-3 * pooled_ref[i]) << "at " << i;
    }
  }
}

TEST(PrefillTilesOpTest, PooledInputTopKKeepsTheLargestTiesLow) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int batch = 5, heads = 3, max_count = 1000, k = 300;
  std::vector<float> scores(size_t(batch) * heads * max_count);
  for (float& v : scores) v = float(rng() % 50) * 0.01f;  // many ties
  std::vector<int32_t> begin(batch, 0), count(batch), row_k(batch);
  for (int b = 0; b < batch; ++b) {
    count[b] = 128 * (b + 1) + 40;
    row_k[b] = std::min(k, 50 + 60 * b);
  }
  auto d_scores = Upload(scores);
  auto d_begin = Upload(begin);
  auto d_count = Upload(count);
  auto d_row_k = Upload(row_k);
  auto selected = gpu_test::Poisoned<int32_t>(size_t(batch) * heads * k);
  auto selected_count = gpu_test::Poisoned<int32_t>(size_t(batch) * heads);
  cuda::DeviceBuffer<unsigned char> workspace;
  const size_t bytes = cuda::PooledTopKWorkspaceBytes(batch, heads, heads, max_count);
  auto allocated = cuda::DeviceBuffer<unsigned char>::Allocate(bytes, "test workspace");
  ASSERT_TRUE(allocated.ok());
  workspace = std::move(allocated).value();
  cuda::PooledTopKParams p;
  p.scores = d_scores.data();
  p.scores_stride = max_count;
  p.begin = d_begin.data();
  p.count = d_count.data();
  p.max_count = max_count;
  p.batch = batch;
  p.num_heads = p.num_kv_heads = heads;
  p.k = k;
  p.row_k = d_row_k.data();
  p.pooled_input = true;
  p.selected = selected.data();
  p.selected_count = selected_count.data();
  p.workspace = workspace.data();
  p.workspace_bytes = bytes;
  ASSERT_STATUS_OK(cuda::PooledTopK(p, nullptr));
  const std::vector<int32_t> got = Download(selected);
  const std::vector<int32_t> got_counts = Download(selected_count);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const float* row = scores.data() + (size_t(b) * heads + h) * max_count;
      std::vector<int> order(static_cast<size_t>(count[b]));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return row[a] > row[c]; });
      order.resize(static_cast<size_t>(row_k[b]));
      std::sort(order.begin(), order.end());
      const size_t r = size_t(b) * heads + h;
      ASSERT_EQ(got_counts[r], row_k[b]);
      ASSERT_EQ(std::vector<int>(got.begin() + r * k, got.begin() + r * k + row_k[b]), order)
          << "row " << b << " head " << h;
    }
  }
}

TEST(PrefillTilesOpTest, BadModeFieldsAreNamed) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  TileCase s;
  s.start = 0;
  s.tokens = 130;
  s.Build(rng);
  cuda::PrefillAttentionParams p = s.Params(PrefillMode::kPool);
  EXPECT_TRUE(gpu_test::FailsWith(cuda::PrefillAttention(p, nullptr), StatusCode::kInvalidArgument,
                                  "lse is null"));
  auto lse = gpu_test::Poisoned<float>(size_t(s.tokens) * s.num_heads());
  p.lse = lse.data();
  p.tile_tokens = 100;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::PrefillAttention(p, nullptr), StatusCode::kInvalidArgument,
                                  "tile_tokens"));
  p.tile_tokens = kTile;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::PrefillAttention(p, nullptr), StatusCode::kInvalidArgument,
                                  "pooled is null"));
  cuda::PrefillAttentionParams list = s.Params(PrefillMode::kList);
  list.recent_tokens = 64;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::PrefillAttention(list, nullptr),
                                  StatusCode::kInvalidArgument, "dense window"));
  list.recent_tokens = INT_MAX;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::PrefillAttention(list, nullptr),
                                  StatusCode::kInvalidArgument, "list_heads 0"));
  list.list_heads = s.kv_heads;
  EXPECT_TRUE(gpu_test::FailsWith(cuda::PrefillAttention(list, nullptr),
                                  StatusCode::kInvalidArgument, "lists and list_counts"));
}

}  // namespace
}  // namespace rubato
