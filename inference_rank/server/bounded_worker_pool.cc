// The worker threads and bounded queue of `rubato serve`'s request preparation (see
// bounded_worker_pool.h).
#include "inference_rank/server/bounded_worker_pool.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "common/logging.h"

namespace rubato::server {

BoundedWorkerPool::BoundedWorkerPool(std::string name, int threads, int max_queued)
    : name_(std::move(name)), max_queued_(static_cast<size_t>(std::max(1, max_queued))) {
  workers_.reserve(static_cast<size_t>(std::max(1, threads)));
  for (int i = 0; i < std::max(1, threads); ++i) workers_.emplace_back([this] { Work(); });
}

BoundedWorkerPool::~BoundedWorkerPool() { Stop(); }

bool BoundedWorkerPool::TryPost(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ || queue_.size() >= max_queued_) return false;
    queue_.push_back(std::move(task));
  }
  wake_.notify_one();
  return true;
}

void BoundedWorkerPool::Stop() {
  std::deque<std::function<void()>> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  wake_.notify_all();
  dropped.clear();  // outside the lock: a task's captures may do anything when destroyed
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

size_t BoundedWorkerPool::queued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size();
}

void BoundedWorkerPool::Work() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      task();
    } catch (const std::exception& e) {
      RUBATO_LOG_ERROR("server", "{} task threw: {}", name_, e.what());
    } catch (...) {
      RUBATO_LOG_ERROR("server", "{} task threw a non-standard exception", name_);
    }
  }
}

int RequestThreads(int configured) {
  if (configured > 0) return configured;
  const unsigned hardware = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hardware, 1u, 4u));
}

}  // namespace rubato::server
