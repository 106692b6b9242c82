// Reconnecting a lost GPU cache rank (device_cache_rank_residency.h). The watcher thread makes
// the new connection (an RPC connect, a Hello and a new communicator: seconds at worst, so never
// on the engine's thread) once none of the rank's requests is open; the engine's thread swaps
// it in at the next admission, between steps, so that the CUDA half never sees a connection
// change under a step; the watcher then drops the one swapped out.
// docs/disaggregated.md "Several GPU cache ranks".
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "common/logging.h"
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"

namespace rubato {

void DeviceCacheRankResidency::InstallReconnected() {
  bool swapped = false;
  {
    std::lock_guard lock(mutex_);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      if (!ready_[r].has_value()) continue;
      DeviceCacheRankPeer& rank = ranks_[r];
      if (rank.client != nullptr) {  // the byte totals carry on
        retired_out_ += rank.client->total_bytes_out();
        retired_back_ += rank.client->total_bytes_back();
      }
      if (rank.owned != nullptr) retired_.push_back(std::move(rank.owned));  // else the caller's
      rank.owned = std::move(ready_[r]->control);
      rank.control = rank.owned.get();
      rank.client = ready_[r]->client;
      ready_[r].reset();
      failed_[r] = Status::Ok();
      ++generation_[r];
      swapped = true;
    }
  }
  if (swapped) wake_.notify_all();  // the watcher drops what was swapped out
}

int DeviceCacheRankResidency::reconnects() const {
  std::lock_guard lock(mutex_);
  return reconnects_;
}

void DeviceCacheRankResidency::Watch() {
  using Clock = std::chrono::steady_clock;
  const size_t ranks = ranks_.size();
  std::vector<int> failed_attempts(ranks, 0);      // since each rank's loss
  std::vector<Clock::time_point> next_try(ranks);  // once an attempt failed
  std::vector<bool> lost(ranks, false);            // the loss was logged
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    if (!retired_.empty()) {
      // Dropped outside the lock: joins their threads, closes their RPC, frees their buffers.
      std::vector<std::unique_ptr<DeviceSessionControl>> old = std::move(retired_);
      retired_.clear();
      lock.unlock();
      old.clear();
      lock.lock();
      continue;
    }
    // A rank to connect: lost, none of its requests open (each Close wakes this thread), its
    // backoff waited out. The others are looked at again every backoff_.first.
    const Clock::time_point now = Clock::now();
    Clock::time_point wake_at = now + backoff_.first;
    size_t due = ranks;
    for (size_t r = 0; r < ranks && due == ranks; ++r) {
      if (ranks_[r].reconnect == nullptr || ready_[r].has_value()) continue;
      const Status why = RankLostLocked(r);
      if (why.ok()) {
        lost[r] = false;
        failed_attempts[r] = 0;
        continue;
      }
      if (!lost[r]) {
        lost[r] = true;
        const std::string rank = ranks > 1 ? fmt::format("cache rank {} of {}: ", r, ranks) : "";
        RUBATO_LOG_WARN("offload", "{}{}; reconnecting once its requests have ended", rank,
                        why.message());
      }
      if (open_[r] > 0) continue;
      if (failed_attempts[r] > 0 && now < next_try[r]) {
        wake_at = std::min(wake_at, next_try[r]);
        continue;
      }
      due = r;
    }
    if (due == ranks) {
      wake_.wait_until(lock, wake_at);
      continue;
    }
    // The connector is never written after construction, and nothing swaps this rank while
    // ready_ is empty: no lock for the attempt.
    lock.unlock();
    Result<DeviceCacheRankConnection> next = ranks_[due].reconnect(&abandon_);
    lock.lock();
    // No session opens on a lost rank; were one open now, the new connection could not take it
    // over: drop it and try again.
    if (stopping_ || (next.ok() && open_[due] > 0)) {
      lock.unlock();
      next = UnavailableError("dropped");  // outside the lock
      lock.lock();
      continue;
    }
    if (!next.ok()) {
      ++failed_attempts[due];
      const std::chrono::milliseconds delay = ReconnectDelay(backoff_, failed_attempts[due]);
      next_try[due] = Clock::now() + delay;
      RUBATO_LOG_WARN("offload", "reconnecting to {}: {}; next try in {} ms", ranks_[due].name,
                      next.status().message(), delay.count());
      continue;
    }
    ready_[due] = std::move(next).value();
    ++reconnects_;
    failed_attempts[due] = 0;  // a later loss is tried at once again, and logged
    lost[due] = false;
    RUBATO_LOG_WARN("offload", "reconnected to {}", ranks_[due].name);
  }
}

}  // namespace rubato
