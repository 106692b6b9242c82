// How a server's accept loop paces itself after failed accepts (descriptors exhausted: EMFILE,
// ENFILE): the pause before the next attempt (10 ms, doubling, at most 1 s) instead of retrying
// at once, which spins a core, and a log line at most once per 10 s carrying the failures since
// the last one. Shared by the cache rank's RPC server and serve's HTTP server; docs/security.md
// "Descriptors".
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace rubato {

class AcceptRetry {
 public:
  static constexpr std::chrono::milliseconds kFirstDelay{10};
  static constexpr std::chrono::milliseconds kMaxDelay{1000};
  static constexpr std::chrono::seconds kLogInterval{10};

  struct Failure {
    std::chrono::milliseconds delay;  // wait this long before accepting again
    int64_t log_count = 0;            // > 0: log now, this many failures since the last line
  };

  Failure OnFailure(std::chrono::steady_clock::time_point now) {
    delay_ = delay_.count() == 0 ? kFirstDelay : std::min(delay_ * 2, kMaxDelay);
    ++failures_;
    Failure failure{delay_, 0};
    if (!logged_once_ || now - logged_ >= kLogInterval) {
      failure.log_count = failures_;
      failures_ = 0;
      logged_ = now;
      logged_once_ = true;
    }
    return failure;
  }

  // An accept succeeded: the next failure starts from the first delay again.
  void OnSuccess() { delay_ = std::chrono::milliseconds(0); }

 private:
  std::chrono::milliseconds delay_{0};
  std::chrono::steady_clock::time_point logged_{};
  bool logged_once_ = false;
  int64_t failures_ = 0;  // since the last log line
};

}  // namespace rubato
