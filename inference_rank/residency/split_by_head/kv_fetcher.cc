// The fetchers of kv_fetcher.h.
#include "inference_rank/residency/split_by_head/kv_fetcher.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace rubato {
namespace {

class ThreadKvFetcher final : public KvFetcher {
 public:
  explicit ThreadKvFetcher(std::chrono::milliseconds delay)
      : delay_(delay), worker_([this] { Run(); }) {}
  ~ThreadKvFetcher() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    ready_.notify_one();
    worker_.join();
  }

  std::shared_future<void> Submit(std::function<void()> job) override {
    std::packaged_task<void()> task(std::move(job));
    std::shared_future<void> done = task.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
    return done;
  }

 private:
  void Run() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped with nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
      task();
    }
  }

  std::chrono::milliseconds delay_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stop_ = false;
  std::thread worker_;  // last: started once the rest exists
};

class DeferredKvFetcher final : public KvFetcher {
 public:
  std::shared_future<void> Submit(std::function<void()> job) override {
    return std::async(std::launch::deferred, std::move(job)).share();
  }
};

}  // namespace

std::unique_ptr<KvFetcher> MakeThreadKvFetcher(std::chrono::milliseconds delay) {
  return std::make_unique<ThreadKvFetcher>(delay);
}

std::unique_ptr<KvFetcher> MakeDeferredKvFetcher() { return std::make_unique<DeferredKvFetcher>(); }

}  // namespace rubato
