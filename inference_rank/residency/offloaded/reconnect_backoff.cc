// ReconnectDelay and the disaggregated mode's backoff (reconnect_backoff.h).
#include "inference_rank/residency/offloaded/reconnect_backoff.h"

#include <algorithm>

namespace rubato {

ReconnectBackoff ReconnectBackoffFromLimits(const LimitsSection& limits) {
  return {std::chrono::milliseconds(limits.heartbeat_ms), std::chrono::milliseconds(10000)};
}

std::chrono::milliseconds ReconnectDelay(const ReconnectBackoff& backoff, int failed_attempts) {
  if (failed_attempts <= 0) return std::chrono::milliseconds(0);
  std::chrono::milliseconds delay = std::min(backoff.first, backoff.max);
  for (int i = 1; i < failed_attempts && delay < backoff.max; ++i) {
    delay = std::min(delay * 2, backoff.max);
  }
  return delay;
}

}  // namespace rubato
