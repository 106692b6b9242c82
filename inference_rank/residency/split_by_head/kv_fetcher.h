// The asynchronous fetch of the split_by_head residency: a job copies rows out of the offloaded
// store into a buffer nobody reads until the job is done (docs/synckv.md "Anticipation"). The
// worker thread is the CPU engine's stand-in for a copy engine; the deferred fetcher runs a job
// only when its result is waited for, i.e. as late as the reader allows (tests).
#pragma once

#include <chrono>
#include <functional>
#include <future>
#include <memory>

namespace rubato {

class KvFetcher {
 public:
  virtual ~KvFetcher() = default;
  // Runs `job` some time before the returned future is ready; never blocks on it.
  virtual std::shared_future<void> Submit(std::function<void()> job) = 0;
};

// One worker thread running jobs in order; `delay` is slept before each (tests: a late fetch).
// Its destructor finishes the queued jobs.
std::unique_ptr<KvFetcher> MakeThreadKvFetcher(
    std::chrono::milliseconds delay = std::chrono::milliseconds(0));
// Runs each job when its future is first waited on, on the waiting thread.
std::unique_ptr<KvFetcher> MakeDeferredKvFetcher();

}  // namespace rubato
