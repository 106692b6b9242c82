// Tests for the evicting residency's slot pool: reserve / release accounting (all arrays held,
// double release), a fresh array's masks and next slots, views of distinct arrays and layers
// never overlapping, writes into the next slots, refused shapes, and a backend's own storage.
#include "inference_rank/kv/slot_kv_pool.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace rubato {
namespace {

TEST(SlotKvPool, ReservesEveryArrayOnceAndTakesThemBack) {
  auto pool = SlotKvPool::Create(SlotKvShape{2, 2, 4, 5, 2}).value();
  EXPECT_EQ(pool->pool_bytes(), SlotKvPool::PoolBytes(pool->shape()));
  SlotKvArrays a, b, c;
  ASSERT_TRUE(pool->Reserve(a).ok());
  ASSERT_TRUE(pool->Reserve(b).ok());
  EXPECT_NE(a.array, b.array);
  EXPECT_EQ(pool->free_arrays(), 0);
  const Status full = pool->Reserve(c);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("all 2 slot arrays of 5 slots are held"), std::string::npos);
  EXPECT_EQ(pool->Reserve(a).code(), StatusCode::kInvalidArgument);  // holds one already

  // Dirty a's masks, hand it back, take it again: fresh.
  const SlotKvView view = pool->LayerView(1, a);
  view.valid[3] = 1;
  view.next_slot[1] = 4;
  SlotKvArrays copy = a;
  ASSERT_TRUE(pool->Release(a).ok());
  EXPECT_EQ(a.array, -1);
  EXPECT_EQ(pool->Release(copy).code(), StatusCode::kInternal);  // a double release
  ASSERT_TRUE(pool->Reserve(c).ok());
  const SlotKvView fresh = pool->LayerView(1, c);
  for (int s = 0; s < 5; ++s) EXPECT_EQ(fresh.valid[s], 0);
  EXPECT_EQ(fresh.next_slot[0], 0);
  EXPECT_EQ(fresh.next_slot[1], 0);
  EXPECT_TRUE(pool->Release(a).ok());  // holds none: a no-op
}

TEST(SlotKvPool, WritesTheNextSlotOfEveryHead) {
  auto pool = SlotKvPool::Create(SlotKvShape{2, 2, 3, 4, 2}).value();
  SlotKvArrays a, b;
  ASSERT_TRUE(pool->Reserve(a).ok());
  ASSERT_TRUE(pool->Reserve(b).ok());
  const SlotKvView view = pool->LayerView(1, a);
  view.next_slot[0] = 2;
  view.next_slot[1] = 3;
  const std::vector<float> key = {1, 2, 3, 4, 5, 6}, value = {-1, -2, -3, -4, -5, -6};
  ASSERT_TRUE(WriteToNextSlots(view, key.data(), value.data()).ok());
  EXPECT_EQ(view.valid[2], 1);
  EXPECT_EQ(view.valid[3], 1);
  EXPECT_EQ(view.valid[0], 0);
  EXPECT_EQ(view.Key(0, 2)[0], 1.f);
  EXPECT_EQ(view.Key(1, 3)[2], 6.f);
  EXPECT_EQ(view.Value(1, 3)[0], -4.f);
  // Other arrays and layers are elsewhere.
  EXPECT_EQ(pool->LayerView(0, a).valid[2], 0);
  EXPECT_EQ(pool->LayerView(1, b).valid[2], 0);
  EXPECT_NE(pool->LayerView(1, b).keys, view.keys);
  view.next_slot[1] = 4;  // past the budget: refused, nothing written
  view.valid[0] = 0;
  const Status bad = WriteToNextSlots(view, key.data(), value.data());
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("KV head 1 has no slot to write (next slot 4, budget 4)"),
            std::string::npos);
}

TEST(SlotKvPool, RefusesEmptyShapes) {
  EXPECT_EQ(SlotKvPool::Create(SlotKvShape{2, 2, 4, 0, 1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SlotKvPool::Create(SlotKvShape{2, 2, 4, 8, 0}).status().code(),
            StatusCode::kInvalidArgument);
}

// A backend's own arrays (the CUDA model's device storage): the pool does the accounting, resets
// an array through the storage at Reserve, reports its bytes and has no host views.
class CountingStorage final : public SlotKvStorage {
 public:
  explicit CountingStorage(std::vector<int>* resets) : resets_(resets) {}
  size_t bytes() const override { return 12345; }
  Status ResetArray(int array) override {
    resets_->push_back(array);
    return Status::Ok();
  }

 private:
  std::vector<int>* resets_;
};

TEST(SlotKvPool, StorageKeepsTheArraysAndThePoolTheAccounting) {
  std::vector<int> resets;
  auto pool = SlotKvPool::CreateWithStorage(SlotKvShape{2, 2, 4, 8, 2},
                                            std::make_unique<CountingStorage>(&resets));
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->pool_bytes(), 12345u);
  SlotKvArrays a, b, c;
  ASSERT_TRUE((*pool)->Reserve(a).ok());
  ASSERT_TRUE((*pool)->Reserve(b).ok());
  EXPECT_EQ((*pool)->Reserve(c).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(resets, (std::vector<int>{0, 1}));
  EXPECT_EQ((*pool)->LayerView(0, a).keys, nullptr);
  ASSERT_TRUE((*pool)->Release(a).ok());
  ASSERT_TRUE((*pool)->Reserve(c).ok());
  EXPECT_EQ(c.array, 0);
  EXPECT_EQ(resets, (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(SlotKvPool::CreateWithStorage(SlotKvShape{2, 2, 4, 8, 2}, nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rubato
