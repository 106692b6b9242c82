// A fixed set of worker threads for data-parallel loops of the CPU backend (attention over
// sequences x KV heads). Work items must write disjoint outputs; which thread runs an item never
// changes its result, so results do not depend on the thread count.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rubato {

class ThreadPool {
 public:
  // `num_workers` >= 1 counts the calling thread: num_workers - 1 threads are started.
  explicit ThreadPool(int num_workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_workers() const { return static_cast<int>(threads_.size()) + 1; }

  // Runs fn(item, worker) for every item in [0, count) and returns when all are done. `worker`
  // is in [0, num_workers()) and identifies the running thread (for per-thread scratch).
  // Not reentrant: fn must not call ParallelFor on the same pool.
  void ParallelFor(int count, const std::function<void(int item, int worker)>& fn);

 private:
  void WorkerLoop(int worker);
  void RunItems(int worker);

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  const std::function<void(int, int)>* job_ = nullptr;  // guarded by mutex_
  int job_count_ = 0;                                   // guarded by mutex_
  uint64_t generation_ = 0;                             // guarded by mutex_; one per job
  int busy_workers_ = 0;                                // guarded by mutex_
  bool stopping_ = false;                               // guarded by mutex_
  std::atomic<int> next_item_{0};
};

}  // namespace rubato
