// Tests of BoundedWorkerPool: the queue's bound refuses at once, Stop drops what waits and lets
// what runs finish, a task that throws does not take its worker down. Part of
// serving_engine_test, which scripts/tsan runs under ThreadSanitizer.
#include "inference_rank/server/bounded_worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>

namespace rubato::server {
namespace {

using std::chrono::seconds;

// A gate the tasks wait at until the test opens it.
class Gate {
 public:
  void Open() { open_.set_value(); }
  void Wait() const { opened_.wait(); }

 private:
  std::promise<void> open_;
  std::shared_future<void> opened_ = open_.get_future().share();
};

// Waits (bounded) until `condition` holds.
template <typename Condition>
bool Eventually(Condition condition) {
  const auto deadline = std::chrono::steady_clock::now() + seconds(20);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(BoundedWorkerPool, AFullQueueRefusesAtOnceAndTakesTasksAgainOnceItDrains) {
  BoundedWorkerPool pool("test", /*threads=*/2, /*max_queued=*/3);
  Gate gate;
  std::atomic<int> started{0};
  std::atomic<int> finished{0};
  const auto task = [&] {
    ++started;
    gate.Wait();
    ++finished;
  };
  // Two run (one per worker), three wait: the sixth is refused without blocking.
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(pool.TryPost(task));
  ASSERT_TRUE(Eventually([&] { return started == 2; }));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool.TryPost(task));
  EXPECT_EQ(pool.queued(), 3u);
  bool ran = false;
  EXPECT_FALSE(pool.TryPost([&] { ran = true; }));
  gate.Open();
  ASSERT_TRUE(Eventually([&] { return finished == 5; }));
  EXPECT_EQ(pool.queued(), 0u);
  EXPECT_TRUE(pool.TryPost(task));
  ASSERT_TRUE(Eventually([&] { return finished == 6; }));
  pool.Stop();
  EXPECT_FALSE(ran);
}

TEST(BoundedWorkerPool, StopDropsQueuedTasksAndWaitsForRunningOnes) {
  auto pool = std::make_unique<BoundedWorkerPool>("test", 1, 4);
  Gate gate;
  std::atomic<bool> running{false};
  std::atomic<bool> finished{false};
  ASSERT_TRUE(pool->TryPost([&] {
    running = true;
    gate.Wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    finished = true;
  }));
  ASSERT_TRUE(Eventually([&] { return running.load(); }));
  // A queued task's captures are destroyed without it running.
  auto token = std::make_shared<int>(0);
  std::weak_ptr<int> watch = token;
  bool ran = false;
  ASSERT_TRUE(pool->TryPost([&ran, token = std::move(token)] { ran = true; }));
  std::thread stopper([&] { pool->Stop(); });
  EXPECT_TRUE(Eventually([&] { return watch.expired(); }));  // dropped before the join
  EXPECT_FALSE(finished);
  gate.Open();
  stopper.join();
  EXPECT_TRUE(finished);  // Stop returned after the running task ended
  EXPECT_FALSE(ran);
  EXPECT_FALSE(pool->TryPost([] {}));  // stopped: refused
  pool->Stop();                        // idempotent
}

TEST(BoundedWorkerPool, ATaskThatThrowsLeavesItsWorkerRunning) {
  BoundedWorkerPool pool("test", 1, 4);
  ASSERT_TRUE(pool.TryPost([] { throw std::runtime_error("a bug"); }));
  std::promise<void> done;
  ASSERT_TRUE(pool.TryPost([&] { done.set_value(); }));
  EXPECT_EQ(done.get_future().wait_for(seconds(20)), std::future_status::ready);
}

TEST(BoundedWorkerPool, RequestThreadsDefaultsToAtMostFour) {
  EXPECT_EQ(RequestThreads(7), 7);
  const int picked = RequestThreads(0);
  EXPECT_GE(picked, 1);
  EXPECT_LE(picked, 4);
}

}  // namespace
}  // namespace rubato::server
