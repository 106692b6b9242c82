// One request's split-by-head KV alone: the prompt's selection installs a front from the store;
// an anticipation copies its local rows, fetches only the others (the delta), and a fetch held
// back changes nothing the anticipation step reads; the next step waits for it and swaps it in.
#include "inference_rank/residency/split_by_head/split_by_head_kv.h"

#include <gtest/gtest.h>

#include <functional>
#include <future>
#include <vector>

namespace rubato {
namespace {

constexpr int kHeads = 3, kDim = 4, kCapacity = 16;

// Holds every job until Release(): a fetch as late as the test wants.
class GatedFetcher final : public KvFetcher {
 public:
  std::shared_future<void> Submit(std::function<void()> job) override {
    jobs_.push_back(std::move(job));
    promises_.emplace_back();
    return promises_.back().get_future().share();
  }
  void Release() {
    for (size_t i = 0; i < jobs_.size(); ++i) {
      jobs_[i]();
      promises_[i].set_value();
    }
    jobs_.clear();
    promises_.clear();
  }
  size_t held() const { return jobs_.size(); }

 private:
  std::vector<std::function<void()>> jobs_;
  std::vector<std::promise<void>> promises_;
};

float Value(int position, int head, int x, bool key) {
  return (key ? 1.0f : -1.0f) * (position * 100 + head * 10 + x + 1);
}

// Layer 0: head 0 the R-head of cluster 0 = {0, 1}; head 2 the R-head of cluster 1 = {2}.
HeadSplit Split() {
  HeadSplit split;
  split.num_layers = 1;
  split.num_kv_heads = kHeads;
  split.cluster = {{0, 0, 1}};
  split.representative = {{0, 2}};
  return split;
}

// The paged cache of one layer, one block of kCapacity tokens, every head's rows.
struct Paged {
  std::vector<float> keys, values;
  int32_t table[1] = {0};
  Paged() : keys(kHeads * kCapacity * kDim), values(kHeads * kCapacity * kDim) {}
  PagedKvView View() {
    return PagedKvView{keys.data(), values.data(), table, kCapacity, kHeads, kDim};
  }
};

// Rows of positions [start, start + tokens) as the model hands them over, also put in `paged`.
void Forward(SplitByHeadKv& kv, Paged& paged, int start, int tokens) {
  std::vector<float> k(static_cast<size_t>(tokens) * kHeads * kDim), v(k.size());
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < kHeads; ++h) {
      for (int x = 0; x < kDim; ++x) {
        const size_t at = (static_cast<size_t>(t) * kHeads + h) * kDim + x;
        k[at] = Value(start + t, h, x, true);
        v[at] = Value(start + t, h, x, false);
        const size_t in_paged = paged.View().Offset(start + t, h) + x;
        paged.keys[in_paged] = k[at];
        paged.values[in_paged] = v[at];
      }
    }
  }
  ASSERT_TRUE(kv.Offload(0, k.data(), v.data(), start, tokens).ok());
}

std::vector<int> FrontPositionsOf(const SplitByHeadKv& kv, int head) {
  const CompactSegment front = kv.Front(0);
  std::vector<int> positions;
  for (int r = 0; r < front.counts[head]; ++r) {
    const float first = front.view.keys[front.view.Offset(head, r)];
    positions.push_back(static_cast<int>((first - 1 - head * 10) / 100));
    for (int x = 0; x < kDim; ++x) {  // every element of the row is the store's
      EXPECT_EQ(front.view.keys[front.view.Offset(head, r) + x],
                Value(positions.back(), head, x, true));
      EXPECT_EQ(front.view.values[front.view.Offset(head, r) + x],
                Value(positions.back(), head, x, false));
    }
  }
  return positions;
}

TEST(SplitByHeadKv, PromptSelectionThenALateFetchSwappedInAtTheNextStep) {
  const HeadSplit split = Split();
  GatedFetcher fetcher;
  SplitByHeadCounters counters;
  Paged paged;
  SplitByHeadKv kv(split, kDim, kCapacity, fetcher, counters);
  Forward(kv, paged, 0, 8);               // the prompt
  EXPECT_EQ(counters.rows_offloaded, 8);  // one NR-head
  EXPECT_FALSE(kv.Installed(0));
  kv.SelectInitial(0, {{1, 0}, {}}, {{6, 5}, {}});
  ASSERT_TRUE(kv.ApplySelection(0, paged.View(), 7).ok());
  EXPECT_TRUE(kv.Installed(0));
  EXPECT_EQ(kv.StaticSet(0, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(FrontPositionsOf(kv, 1), (std::vector<int>{0, 1, 5, 6}));
  EXPECT_EQ(kv.Front(0).counts[0], 0);  // R-heads read the paged cache
  EXPECT_EQ(kv.Front(0).counts[2], 0);
  EXPECT_EQ(kv.recent_begin(0), 8);

  // Step 8 anticipates {2, 3} (in the store only), 6 (in the front) and 8 (recent).
  ASSERT_TRUE(kv.BeginStep(0, 8).ok());
  Forward(kv, paged, 8, 1);
  kv.Anticipate(0, {{8, 2, 6, 3}, {}});
  ASSERT_TRUE(kv.ApplySelection(0, paged.View(), 8).ok());
  EXPECT_EQ(fetcher.held(), 1u);
  EXPECT_EQ(counters.rows_fetched, 2);  // the delta: rows 6 and 8 were already local
  EXPECT_EQ(counters.rows_reused, 2);
  EXPECT_EQ(counters.bytes_fetched, 2 * 2 * kDim * 4);
  // The anticipation step reads the old front, before and after its fetch arrives.
  const std::vector<int> before = FrontPositionsOf(kv, 1);
  EXPECT_EQ(before, (std::vector<int>{0, 1, 5, 6}));
  fetcher.Release();
  EXPECT_EQ(FrontPositionsOf(kv, 1), before);
  EXPECT_EQ(kv.recent_begin(0), 8);
  EXPECT_EQ(kv.LocalBytes(0, 8), (2 * 9 + 4 + 1) * 2 * kDim * 4);

  // Step 9 reads it: static {0, 1} and dynamic {2, 3, 6, 8}, then the recent positions from 9.
  ASSERT_TRUE(kv.BeginStep(0, 9).ok());
  EXPECT_EQ(FrontPositionsOf(kv, 1), (std::vector<int>{0, 1, 2, 3, 6, 8}));
  EXPECT_EQ(kv.recent_begin(0), 9);
  EXPECT_EQ(counters.fetches, 1);
}

TEST(SplitByHeadKv, AStepWaitsForTheFetchItReads) {
  const HeadSplit split = Split();
  std::unique_ptr<KvFetcher> fetcher = MakeDeferredKvFetcher();  // runs when waited for
  SplitByHeadCounters counters;
  Paged paged;
  SplitByHeadKv kv(split, kDim, kCapacity, *fetcher, counters);
  Forward(kv, paged, 0, 4);
  kv.SelectInitial(0, {{0}, {}}, {{1}, {}});
  ASSERT_TRUE(kv.ApplySelection(0, paged.View(), 3).ok());
  ASSERT_TRUE(kv.BeginStep(0, 4).ok());
  Forward(kv, paged, 4, 1);
  kv.Anticipate(0, {{2, 3}, {}});
  ASSERT_TRUE(kv.ApplySelection(0, paged.View(), 4).ok());
  EXPECT_EQ(FrontPositionsOf(kv, 1), (std::vector<int>{0, 1}));
  ASSERT_TRUE(kv.BeginStep(0, 5).ok());  // the deferred job runs here
  EXPECT_EQ(FrontPositionsOf(kv, 1), (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(counters.rows_fetched, 2);
}

TEST(SplitByHeadKv, PositionsOutsideTheStoreAreRefused) {
  const HeadSplit split = Split();
  std::unique_ptr<KvFetcher> fetcher = MakeThreadKvFetcher();
  SplitByHeadCounters counters;
  SplitByHeadKv kv(split, kDim, 4, *fetcher, counters);
  std::vector<float> rows(5 * kHeads * kDim, 1.0f);
  const Status status = kv.Offload(0, rows.data(), rows.data(), 0, 5);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("outside the request's store of 4"), std::string::npos);
}

}  // namespace
}  // namespace rubato
