// SyncKV's and split_by_head's CUDA ops against their CPU twins, every element: the selection
// evidence (group_max_probs.cuh vs group_max_probs_cpu.h) and the device pool's bookkeeping and
// row copies (head_pool.cuh vs head_pool_cpu.h) over an install and several anticipations, with
// rows both local (the paged cache) and fetched (the store).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "inference_rank/policies/synckv/kernels/group_max_probs.cuh"
#include "inference_rank/policies/synckv/kernels/group_max_probs_cpu.h"
#include "inference_rank/residency/split_by_head/kernels/head_pool.cuh"
#include "inference_rank/residency/split_by_head/kernels/head_pool_cpu.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using namespace gpu_test;

// `count` distinct ascending positions of [0, range) not in `excluded`.
std::vector<int32_t> RandomSet(std::mt19937_64& rng, int count, int range,
                               const std::vector<int32_t>& excluded = {}) {
  std::vector<int32_t> all;
  for (int p = 0; p < range; ++p) {
    if (!std::binary_search(excluded.begin(), excluded.end(), p)) all.push_back(p);
  }
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(std::min<size_t>(all.size(), static_cast<size_t>(count)));
  std::sort(all.begin(), all.end());
  return all;
}

TEST(SyncKvGroupMaxProbs, MatchesTheCpuTwinEveryElement) {
  std::mt19937_64 rng = FreshRng();
  constexpr int kRows = 6, kGroup = 4, kStride = 320, kSlots = 8, kExcludedStride = 48;
  std::uniform_real_distribution<float> score(-12.0f, 12.0f);
  std::vector<float> scores(static_cast<size_t>(kRows) * kGroup * kStride);
  for (float& s : scores) s = score(rng);
  for (int i = 0; i < 40; ++i) {  // non-finite scores count as -inf
    scores[rng() % scores.size()] = i % 2 ? -std::numeric_limits<float>::infinity() : NAN;
  }
  std::vector<int32_t> lengths(kRows), index(kRows), count(kRows);
  std::vector<int32_t> excluded(static_cast<size_t>(kSlots) * kExcludedStride, -1);
  for (int r = 0; r < kRows; ++r) {
    lengths[r] = 1 + static_cast<int>(rng() % (kStride - 1));
    if (r == 0) lengths[r] = 1;
    index[r] = static_cast<int>(rng() % kSlots);
  }
  for (int s = 0; s < kSlots; ++s) {
    const std::vector<int32_t> set = RandomSet(rng, kExcludedStride, kStride);
    std::copy(set.begin(), set.end(), excluded.begin() + static_cast<size_t>(s) * kExcludedStride);
  }
  for (int r = 0; r < kRows; ++r) count[r] = static_cast<int>(rng() % (kExcludedStride + 1));

  auto d_scores = Upload(scores);
  auto d_lengths = Upload(lengths);
  auto d_index = Upload(index);
  auto d_count = Upload(count);
  auto d_excluded = Upload(excluded);
  auto d_out = Poisoned<float>(static_cast<size_t>(kRows) * kStride);
  cuda::GroupMaxProbsParams p;
  p.scores = d_scores.data();
  p.scores_stride = kStride;
  p.lengths = d_lengths.data();
  p.max_length = kStride;
  p.rows = kRows;
  p.group = kGroup;
  p.excluded = d_excluded.data();
  p.excluded_index = d_index.data();
  p.excluded_count = d_count.data();
  p.excluded_row_stride = kExcludedStride;
  p.excluded_capacity = kExcludedStride;
  p.out = d_out.data();
  p.out_row_stride = kStride;
  ASSERT_STATUS_OK(cuda::GroupMaxProbs(p, nullptr));
  const std::vector<float> out = Download(d_out);
  double worst = 0.0;
  for (int r = 0; r < kRows; ++r) {
    std::vector<float> expected(static_cast<size_t>(lengths[r]));
    GroupMaxProbsRow(scores.data() + static_cast<size_t>(r) * kGroup * kStride, kStride, kGroup,
                     lengths[r], excluded.data() + static_cast<size_t>(index[r]) * kExcludedStride,
                     count[r], expected.data());
    for (int i = 0; i < lengths[r]; ++i) {
      const float got = out[static_cast<size_t>(r) * kStride + i];
      if (std::isinf(expected[i])) {
        EXPECT_EQ(got, expected[i]) << "row " << r << " position " << i;
        continue;
      }
      const double error = std::fabs(got - expected[i]);
      worst = std::max(worst, error);
      EXPECT_LE(error, 1e-7 + 1e-5 * std::fabs(expected[i])) << "row " << r << " position " << i;
    }
    for (int i = lengths[r]; i < kStride; ++i) {  // past the length: untouched (poison)
      EXPECT_TRUE(std::isnan(out[static_cast<size_t>(r) * kStride + i])) << "row " << r;
    }
  }
  std::printf("group_max_probs: max abs error %.3g\n", worst);
}

// The device pool and its CPU twin side by side.
struct PoolFixture {
  static constexpr int kSlots = 3, kClusters = 2, kHeads = 5, kPool = 40, kContext = 128;
  static constexpr int kDim = 16, kBlockTokens = 16, kBlocks = 24, kRows = 2;
  std::vector<int32_t> cluster_of = {-1, 0, 1, 0, -1}, store_index = {-1, 0, 1, 2, -1};
  std::vector<int32_t> slot = {2, 0};
  // Host mirrors.
  std::vector<int32_t> positions, row_of, sizes, counts;
  std::vector<uint16_t> paged_keys, paged_values, store_keys, store_values, pool_keys, pool_values;
  std::vector<int32_t> tables;  // [rows][kContext / kBlockTokens]
  // Device.
  cuda::DeviceBuffer<int32_t> d_positions, d_row_of, d_sizes, d_counts, d_cluster_of, d_store_index,
      d_slot, d_tables, d_table_index;
  cuda::DeviceBuffer<uint16_t> d_paged_keys, d_paged_values, d_store_keys, d_store_values,
      d_pool_keys, d_pool_values;

  explicit PoolFixture(std::mt19937_64& rng) {
    const size_t books = static_cast<size_t>(kSlots) * kClusters;
    positions.assign(books * kPool, 0);
    row_of.assign(books * kContext, -1);
    sizes.assign(books * 2, 0);
    counts.assign(static_cast<size_t>(kSlots) * kHeads, 0);
    auto random_bits = [&](size_t n) {
      std::vector<uint16_t> v(n);
      for (uint16_t& x : v) x = static_cast<uint16_t>(rng());
      return v;
    };
    paged_keys = random_bits(static_cast<size_t>(kBlocks) * kHeads * kBlockTokens * kDim);
    paged_values = random_bits(paged_keys.size());
    store_keys = random_bits(static_cast<size_t>(3) * kSlots * kContext * kDim);
    store_values = random_bits(store_keys.size());
    pool_keys.assign(static_cast<size_t>(kSlots) * kHeads * kPool * kDim, 0);
    pool_values = pool_keys;
    std::vector<int32_t> blocks(kBlocks);
    for (int b = 0; b < kBlocks; ++b) blocks[b] = b;
    for (int r = 0; r < kRows; ++r) {
      std::shuffle(blocks.begin(), blocks.end(), rng);
      tables.insert(tables.end(), blocks.begin(), blocks.begin() + kContext / kBlockTokens);
    }
    d_positions = Upload(positions);
    d_row_of = Upload(row_of);
    d_sizes = Upload(sizes);
    d_counts = Upload(counts);
    d_cluster_of = Upload(cluster_of);
    d_store_index = Upload(store_index);
    d_slot = Upload(slot);
    d_tables = Upload(tables);
    d_table_index = Upload(std::vector<int32_t>{0, 1});
    d_paged_keys = Upload(paged_keys);
    d_paged_values = Upload(paged_values);
    d_store_keys = Upload(store_keys);
    d_store_values = Upload(store_values);
    d_pool_keys = Upload(pool_keys);
    d_pool_values = Upload(pool_values);
  }

  cuda::HeadPoolBook Book() {
    cuda::HeadPoolBook b;
    b.positions = d_positions.data();
    b.row_of = d_row_of.data();
    b.sizes = d_sizes.data();
    b.counts = d_counts.data();
    b.cluster_of = d_cluster_of.data();
    b.slots = kSlots;
    b.clusters = kClusters;
    b.kv_heads = kHeads;
    b.pool_capacity = kPool;
    b.context_capacity = kContext;
    return b;
  }

  // One selection on both: `statics` (install) and `sets` per (row, cluster); rows of positions
  // >= local_from[row] copied from the paged cache, the others from the store.
  void Apply(bool install, const std::vector<std::vector<int32_t>>& statics,
             const std::vector<std::vector<int32_t>>& sets,
             const std::vector<int32_t>& local_from) {
    const int stride = kPool;
    std::vector<int32_t> selected(static_cast<size_t>(kRows) * kClusters * stride, -1),
        selected_count(static_cast<size_t>(kRows) * kClusters, 0), fixed = selected,
                                                                   fixed_count = selected_count;
    for (int pair = 0; pair < kRows * kClusters; ++pair) {
      std::copy(sets[pair].begin(), sets[pair].end(), selected.begin() + pair * stride);
      selected_count[pair] = static_cast<int32_t>(sets[pair].size());
      if (install) {
        std::copy(statics[pair].begin(), statics[pair].end(), fixed.begin() + pair * stride);
        fixed_count[pair] = static_cast<int32_t>(statics[pair].size());
      }
    }
    auto d_selected = Upload(selected);
    auto d_selected_count = Upload(selected_count);
    auto d_fixed = Upload(fixed);
    auto d_fixed_count = Upload(fixed_count);
    auto d_scratch = Poisoned<int32_t>(static_cast<size_t>(kRows) * kClusters * kPool);
    auto d_move_rows = Poisoned<int32_t>(static_cast<size_t>(kRows) * kClusters * kPool);
    auto d_move_positions = Poisoned<int32_t>(d_move_rows.size());
    auto d_move_count = Poisoned<int32_t>(static_cast<size_t>(kRows) * kClusters);
    auto d_local_from = Upload(local_from);
    cuda::HeadPoolUpdateParams u;
    u.book = Book();
    u.install = install;
    u.rows = kRows;
    u.slot = d_slot.data();
    u.selected = d_selected.data();
    u.selected_count = d_selected_count.data();
    u.selected_stride = stride;
    u.static_selected = d_fixed.data();
    u.static_count = d_fixed_count.data();
    u.scratch = d_scratch.data();
    u.move_rows = d_move_rows.data();
    u.move_positions = d_move_positions.data();
    u.move_count = d_move_count.data();
    ASSERT_STATUS_OK(cuda::HeadPoolUpdate(u, nullptr));
    cuda::HeadPoolCopyParams c;
    c.rows = kRows;
    c.clusters = kClusters;
    c.kv_heads = kHeads;
    c.head_dim = kDim;
    c.cluster_of = d_cluster_of.data();
    c.store_index = d_store_index.data();
    c.slot = d_slot.data();
    c.move_rows = d_move_rows.data();
    c.move_positions = d_move_positions.data();
    c.move_count = d_move_count.data();
    c.move_stride = kPool;
    c.local_from = d_local_from.data();
    c.key_pool = reinterpret_cast<const __nv_bfloat16*>(d_paged_keys.data());
    c.value_pool = reinterpret_cast<const __nv_bfloat16*>(d_paged_values.data());
    c.block_tables = d_tables.data();
    c.table_index = d_table_index.data();
    c.block_table_stride = kContext / kBlockTokens;
    c.block_tokens = kBlockTokens;
    c.store_keys = reinterpret_cast<const __nv_bfloat16*>(d_store_keys.data());
    c.store_values = reinterpret_cast<const __nv_bfloat16*>(d_store_values.data());
    c.store_rows = static_cast<int64_t>(kSlots) * kContext;
    c.context_capacity = kContext;
    c.pool_keys = reinterpret_cast<__nv_bfloat16*>(d_pool_keys.data());
    c.pool_values = reinterpret_cast<__nv_bfloat16*>(d_pool_values.data());
    c.pool_capacity = kPool;
    c.source = cuda::HeadPoolSource::kLocal;
    ASSERT_STATUS_OK(cuda::HeadPoolCopy(c, nullptr));
    c.source = cuda::HeadPoolSource::kStore;
    ASSERT_STATUS_OK(cuda::HeadPoolCopy(c, nullptr));
    const std::vector<int32_t> move_rows = Download(d_move_rows),
                               move_positions = Download(d_move_positions),
                               move_count = Download(d_move_count);

    // The twin, pair by pair.
    for (int row = 0; row < kRows; ++row) {
      for (int cluster = 0; cluster < kClusters; ++cluster) {
        const int pair = row * kClusters + cluster;
        const size_t book = static_cast<size_t>(slot[row]) * kClusters + cluster;
        HeadPoolBookRow b{positions.data() + book * kPool, row_of.data() + book * kContext,
                          sizes.data() + book * 2, kPool, kContext};
        const HeadPoolMoves moves = install ? HeadPoolInstallCpu(b, statics[pair], sets[pair])
                                            : HeadPoolAnticipateCpu(b, sets[pair]);
        ASSERT_EQ(move_count[pair], static_cast<int>(moves.rows.size())) << "pair " << pair;
        for (size_t m = 0; m < moves.rows.size(); ++m) {
          EXPECT_EQ(move_rows[pair * kPool + m], moves.rows[m]) << "pair " << pair << " move " << m;
          EXPECT_EQ(move_positions[pair * kPool + m], moves.positions[m]);
        }
        for (int h = 0; h < kHeads; ++h) {
          if (cluster_of[h] != cluster) continue;
          counts[static_cast<size_t>(slot[row]) * kHeads + h] = b.sizes[0] + b.sizes[1];
          const size_t pool_head = (static_cast<size_t>(slot[row]) * kHeads + h) * kPool * kDim;
          for (int kind = 0; kind < 2; ++kind) {
            const std::vector<uint16_t>& paged = kind == 0 ? paged_keys : paged_values;
            const std::vector<uint16_t>& store = kind == 0 ? store_keys : store_values;
            std::vector<uint16_t>& pool = kind == 0 ? pool_keys : pool_values;
            HeadPoolCopyCpu(
                moves, kDim,
                [&](int p) -> const uint16_t* {
                  if (p >= local_from[row]) {
                    const int block = tables[static_cast<size_t>(row) * (kContext / kBlockTokens) +
                                             p / kBlockTokens];
                    return paged.data() +
                           ((static_cast<size_t>(block) * kHeads + h) * kBlockTokens +
                            p % kBlockTokens) *
                               kDim;
                  }
                  return store.data() + (static_cast<size_t>(store_index[h]) * kSlots * kContext +
                                         static_cast<size_t>(slot[row]) * kContext + p) *
                                            kDim;
                },
                [](int) { return true; }, pool.data() + pool_head);
          }
        }
      }
    }
    EXPECT_EQ(Download(d_positions), positions);
    EXPECT_EQ(Download(d_row_of), row_of);
    EXPECT_EQ(Download(d_sizes), sizes);
    EXPECT_EQ(Download(d_counts), counts);
    EXPECT_EQ(Download(d_pool_keys), pool_keys);
    EXPECT_EQ(Download(d_pool_values), pool_values);
  }
};

TEST(SplitByHeadPool, InstallAndAnticipationsMatchTheCpuTwinEveryElement) {
  std::mt19937_64 rng = FreshRng();
  PoolFixture pool(rng);
  constexpr int kPairs = PoolFixture::kRows * PoolFixture::kClusters;
  std::vector<std::vector<int32_t>> statics(kPairs), sets(kPairs);
  int context = 60;
  for (int pair = 0; pair < kPairs; ++pair) {
    statics[pair] = RandomSet(rng, 8, context);
    sets[pair] = RandomSet(rng, 10, context, statics[pair]);
  }
  pool.Apply(true, statics, sets, {0, 0});  // the prompt: all of it in the paged cache
  int dynamic = 10;
  for (int round = 0; round < 6; ++round) {
    context += 11;
    dynamic += static_cast<int>(rng() % 3);  // the budget grows with the context
    for (int pair = 0; pair < kPairs; ++pair) {
      // Keep some of the old dynamic rows, add others, some of them recent.
      std::vector<int32_t> set = RandomSet(rng, dynamic, context, statics[pair]);
      sets[pair] = set;
    }
    SCOPED_TRACE("round " + std::to_string(round));
    pool.Apply(false, statics, sets, {context - 9, context - 4});
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace
}  // namespace rubato
