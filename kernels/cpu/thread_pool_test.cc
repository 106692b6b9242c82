// Tests for the CPU thread pool: every item runs exactly once, worker ids are in range, and the
// pool can run many jobs back to back.
#include "kernels/cpu/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace rubato {
namespace {

TEST(ThreadPool, RunsEveryItemOnceWithValidWorkerIds) {
  for (int workers : {1, 2, 4}) {
    ThreadPool pool(workers);
    EXPECT_EQ(pool.num_workers(), workers);
    for (int count : {0, 1, 3, 100}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(count));
      std::atomic<bool> bad_worker{false};
      pool.ParallelFor(count, [&](int item, int worker) {
        runs[static_cast<size_t>(item)].fetch_add(1);
        if (worker < 0 || worker >= workers) bad_worker = true;
      });
      for (int i = 0; i < count; ++i) ASSERT_EQ(runs[static_cast<size_t>(i)].load(), 1) << i;
      EXPECT_FALSE(bad_worker.load());
    }
  }
}

TEST(ThreadPool, ManyConsecutiveJobs) {
  ThreadPool pool(3);
  std::vector<long> sums(8, 0);
  for (int job = 0; job < 500; ++job) {
    pool.ParallelFor(8, [&](int item, int) { sums[static_cast<size_t>(item)] += job; });
  }
  for (long s : sums) EXPECT_EQ(s, 499L * 500 / 2);
}

}  // namespace
}  // namespace rubato
