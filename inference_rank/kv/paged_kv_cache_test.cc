// Tests for the paged KV cache: block accounting, all-or-nothing reservation, exhaustion as an
// error, release and reuse, releasing the blocks before a position, that layer views of different
// layers and sequences never alias, and that a cache with a backend's storage does the same
// accounting without host pools.
#include "inference_rank/kv/paged_kv_cache.h"

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <vector>

#include "kernels/cpu/kv_append.h"

namespace rubato {
namespace {

KvCacheShape SmallShape(int num_blocks) {
  return KvCacheShape{/*num_layers=*/2, /*num_kv_heads=*/2, /*head_dim=*/4,
                      /*block_tokens=*/16, num_blocks};
}

TEST(PagedKvCache, RejectsBadShapes) {
  KvCacheShape shape = SmallShape(4);
  shape.block_tokens = 32;
  auto bad_block = PagedKvCache::Create(shape);
  ASSERT_FALSE(bad_block.ok());
  EXPECT_NE(bad_block.status().message().find("block size 32"), std::string::npos);
  EXPECT_FALSE(PagedKvCache::Create(SmallShape(0)).ok());
  shape = SmallShape(4);
  shape.head_dim = 0;
  EXPECT_FALSE(PagedKvCache::Create(shape).ok());
}

TEST(PagedKvCache, ReservesWholeBlocksAndCountsThem) {
  auto cache = PagedKvCache::Create(SmallShape(5));
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  PagedKvCache& kv = **cache;
  EXPECT_EQ(kv.pool_bytes(), 2u * 4 * 2 * 5 * 2 * 16 * 4);
  KvSequence a;
  ASSERT_TRUE(kv.Reserve(a, 1).ok());
  EXPECT_EQ(a.block_table.size(), 1u);
  EXPECT_EQ(kv.Capacity(a), 16);
  ASSERT_TRUE(kv.Reserve(a, 16).ok());  // still fits
  EXPECT_EQ(a.block_table.size(), 1u);
  ASSERT_TRUE(kv.Reserve(a, 17).ok());
  EXPECT_EQ(a.block_table.size(), 2u);
  EXPECT_EQ(kv.free_blocks(), 3);
  EXPECT_EQ(kv.used_blocks(), 2);
  EXPECT_EQ(kv.BlocksFor(0), 0);
  EXPECT_EQ(kv.BlocksFor(33), 3);
}

TEST(PagedKvCache, ExhaustionIsAnErrorAndTakesNothing) {
  auto cache = PagedKvCache::Create(SmallShape(3));
  ASSERT_TRUE(cache.ok());
  PagedKvCache& kv = **cache;
  KvSequence a, b;
  ASSERT_TRUE(kv.Reserve(a, 20).ok());      // 2 blocks
  const Status status = kv.Reserve(b, 40);  // needs 3, 1 free
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("40 tokens need 3 more blocks of 16 tokens but only 1 of 3"),
            std::string::npos)
      << status.message();
  EXPECT_TRUE(b.block_table.empty());
  EXPECT_EQ(kv.free_blocks(), 1);
  // After a is released, b fits.
  ASSERT_TRUE(kv.Release(a).ok());
  EXPECT_TRUE(a.block_table.empty());
  EXPECT_EQ(kv.free_blocks(), 3);
  EXPECT_TRUE(kv.Reserve(b, 40).ok());
  EXPECT_EQ(kv.free_blocks(), 0);
}

TEST(PagedKvCache, DoubleReleaseIsReported) {
  auto cache = PagedKvCache::Create(SmallShape(2));
  ASSERT_TRUE(cache.ok());
  KvSequence a;
  ASSERT_TRUE((*cache)->Reserve(a, 5).ok());
  KvSequence copy = a;
  ASSERT_TRUE((*cache)->Release(a).ok());
  EXPECT_EQ((*cache)->Release(copy).code(), StatusCode::kInternal);
  EXPECT_EQ((*cache)->free_blocks(), 2);
}

// ReleaseBefore gives back only whole blocks before the position, keeps the table's length
// (later positions map as before), is idempotent, and Release then frees what is left.
TEST(PagedKvCache, ReleaseBeforeKeepsTheTableAndFreesWholeBlocks) {
  auto cache = PagedKvCache::Create(SmallShape(8));
  ASSERT_TRUE(cache.ok());
  KvSequence sequence;
  ASSERT_TRUE((*cache)->Reserve(sequence, 60).ok());  // 4 blocks
  sequence.num_tokens = 60;
  const int32_t third = sequence.block_table[2];
  ASSERT_TRUE((*cache)->ReleaseBefore(sequence, 47).ok());  // blocks 0, 1; 2 holds 32..47
  EXPECT_EQ(sequence.block_table.size(), 4u);
  EXPECT_EQ(sequence.block_table[0], kReleasedBlock);
  EXPECT_EQ(sequence.block_table[1], kReleasedBlock);
  EXPECT_EQ(sequence.block_table[2], third);
  EXPECT_EQ(sequence.released_blocks, 2);
  EXPECT_EQ(sequence.num_tokens, 60);
  EXPECT_EQ(PagedKvCache::HeldBlocks(sequence), 2);
  EXPECT_EQ((*cache)->free_blocks(), 6);
  EXPECT_EQ((*cache)->FirstReleasedPosition(sequence, 10, 40), 10);
  EXPECT_EQ((*cache)->FirstReleasedPosition(sequence, 31, 33), 31);
  EXPECT_EQ((*cache)->FirstReleasedPosition(sequence, 32, 60), -1);
  ASSERT_TRUE((*cache)->ReleaseBefore(sequence, 20).ok());  // nothing more
  EXPECT_EQ((*cache)->free_blocks(), 6);
  ASSERT_TRUE((*cache)->Reserve(sequence, 70).ok());  // grows at the end
  EXPECT_EQ(sequence.block_table.size(), 5u);
  EXPECT_EQ((*cache)->free_blocks(), 5);
  ASSERT_TRUE((*cache)->Release(sequence).ok());
  EXPECT_EQ((*cache)->free_blocks(), 8);
  EXPECT_EQ(sequence.released_blocks, 0);
}

TEST(PagedKvCache, LayersAndSequencesDoNotAlias) {
  const KvCacheShape shape = SmallShape(4);
  auto cache = PagedKvCache::Create(shape);
  ASSERT_TRUE(cache.ok());
  PagedKvCache& kv = **cache;
  KvSequence a, b;
  ASSERT_TRUE(kv.Reserve(a, 20).ok());
  ASSERT_TRUE(kv.Reserve(b, 30).ok());
  std::set<int32_t> blocks(a.block_table.begin(), a.block_table.end());
  blocks.insert(b.block_table.begin(), b.block_table.end());
  EXPECT_EQ(blocks.size(), 4u);

  // Write a distinct value per (layer, sequence, position, head, dim), then read all back.
  const int row = shape.num_kv_heads * shape.head_dim;
  auto value = [&](int layer, int seq, int pos, int i) {
    return float(layer * 100000 + seq * 10000 + pos * 100 + i);
  };
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    for (int seq = 0; seq < 2; ++seq) {
      const int tokens = seq == 0 ? 20 : 30;
      std::vector<float> k(tokens * row), v(tokens * row);
      for (int p = 0; p < tokens; ++p) {
        for (int i = 0; i < row; ++i) {
          k[p * row + i] = value(layer, seq, p, i);
          v[p * row + i] = -value(layer, seq, p, i);
        }
      }
      AppendToPagedKv(k.data(), v.data(), tokens, 0, kv.LayerView(layer, seq == 0 ? a : b));
    }
  }
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    for (int seq = 0; seq < 2; ++seq) {
      const PagedKvView view = kv.LayerView(layer, seq == 0 ? a : b);
      for (int p = 0; p < (seq == 0 ? 20 : 30); ++p) {
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          for (int d = 0; d < shape.head_dim; ++d) {
            const float expected = value(layer, seq, p, h * shape.head_dim + d);
            ASSERT_EQ(view.keys[view.Offset(p, h) + d], expected);
            ASSERT_EQ(view.values[view.Offset(p, h) + d], -expected);
          }
        }
      }
    }
  }
}

// A backend's pools as the CUDA model would hold them; counts its own destruction.
class FakeStorage : public KvStorage {
 public:
  explicit FakeStorage(bool* destroyed) : destroyed_(destroyed) {}
  ~FakeStorage() override { *destroyed_ = true; }
  size_t bytes() const override { return 12345; }

 private:
  bool* destroyed_;
};

TEST(PagedKvCache, ExternalStorageKeepsTheAccountingAndOwnsTheStorage) {
  bool destroyed = false;
  {
    auto cache =
        PagedKvCache::CreateWithStorage(SmallShape(3), std::make_unique<FakeStorage>(&destroyed));
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    PagedKvCache& kv = **cache;
    ASSERT_NE(kv.storage(), nullptr);
    EXPECT_NE(dynamic_cast<FakeStorage*>(kv.storage()), nullptr);
    EXPECT_EQ(kv.pool_bytes(), 12345u);
    KvSequence a, b;
    ASSERT_TRUE(kv.Reserve(a, 20).ok());
    EXPECT_EQ(kv.free_blocks(), 1);
    EXPECT_EQ(kv.Reserve(b, 40).code(), StatusCode::kResourceExhausted);
    EXPECT_TRUE(b.block_table.empty());
    // No host pools: the view is empty rather than pointing at memory that is not there.
    const PagedKvView view = kv.LayerView(0, a);
    EXPECT_EQ(view.keys, nullptr);
    EXPECT_EQ(view.values, nullptr);
    ASSERT_TRUE(kv.Release(a).ok());
    EXPECT_EQ(kv.free_blocks(), 3);
    EXPECT_FALSE(destroyed);
  }
  EXPECT_TRUE(destroyed);
}

TEST(PagedKvCache, ExternalStorageValidatesTheShapeAndNeedsStorage) {
  bool destroyed = false;
  KvCacheShape shape = SmallShape(3);
  shape.block_tokens = 8;
  EXPECT_EQ(PagedKvCache::CreateWithStorage(shape, std::make_unique<FakeStorage>(&destroyed))
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PagedKvCache::CreateWithStorage(SmallShape(3), nullptr).status().code(),
            StatusCode::kInvalidArgument);
  // A host-pool cache has no backend storage.
  auto host = PagedKvCache::Create(SmallShape(3));
  ASSERT_TRUE(host.ok());
  EXPECT_EQ((*host)->storage(), nullptr);
}

}  // namespace
}  // namespace rubato
