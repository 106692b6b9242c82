// A fixed set of worker threads fed by a bounded queue: `rubato serve` parses, templates and
// tokenizes request bodies there, so that the HTTP server's I/O thread never does seconds of
// work for one client. A full queue refuses the task at once (the caller answers the overload);
// Stop drops the tasks not started and waits for those running.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace rubato::server {

class BoundedWorkerPool {
 public:
  // `threads` >= 1 workers named `name` in logs; at most `max_queued` (>= 1) tasks wait for one.
  BoundedWorkerPool(std::string name, int threads, int max_queued);
  ~BoundedWorkerPool();  // Stop()
  BoundedWorkerPool(const BoundedWorkerPool&) = delete;
  BoundedWorkerPool& operator=(const BoundedWorkerPool&) = delete;

  // Queues `task` for the next free worker. False (and `task` untouched by any thread) when
  // max_queued tasks wait already or the pool has stopped. A task that throws is logged; the
  // worker goes on.
  bool TryPost(std::function<void()> task);
  // Takes no more tasks, destroys the queued ones without running them and joins the workers
  // once their current tasks end. Idempotent; not from a task.
  void Stop();

  size_t queued() const;  // tasks waiting for a worker
  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  void Work();

  const std::string name_;
  const size_t max_queued_;
  mutable std::mutex mutex_;  // guards the fields below
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;  // set in the constructor, joined by Stop
};

// server.request_threads as configured: 0 picks min(4, hardware threads), at least 1.
int RequestThreads(int configured);

}  // namespace rubato::server
