// Worker threads for data-parallel loops (see thread_pool.h).
//
// One job at a time: ParallelFor publishes the job under the mutex and bumps a generation
// counter; workers (and the caller) claim items from an atomic counter until none are left,
// then the caller waits until every worker has checked out of the job.
#include "kernels/cpu/thread_pool.h"

#include <algorithm>

namespace rubato {

ThreadPool::ThreadPool(int num_workers) {
  const int threads = std::max(num_workers, 1) - 1;
  threads_.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this, i] { WorkerLoop(i + 1); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::ParallelFor(int count, const std::function<void(int, int)>& fn) {
  if (count <= 0) return;
  if (threads_.empty() || count == 1) {
    for (int i = 0; i < count; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_count_ = count;
    next_item_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<int>(threads_.size());
    ++generation_;
  }
  work_ready_.notify_all();
  RunItems(0);
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [this] { return busy_workers_ == 0; });
  job_ = nullptr;
}

void ThreadPool::RunItems(int worker) {
  const std::function<void(int, int)>* fn;
  int count;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn = job_;
    count = job_count_;
  }
  for (int item = next_item_.fetch_add(1); item < count; item = next_item_.fetch_add(1)) {
    (*fn)(item, worker);
  }
}

void ThreadPool::WorkerLoop(int worker) {
  uint64_t seen_generation = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen_generation; });
      if (stopping_) return;
      seen_generation = generation_;
    }
    RunItems(worker);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --busy_workers_;
    }
    work_done_.notify_one();
  }
}

}  // namespace rubato
