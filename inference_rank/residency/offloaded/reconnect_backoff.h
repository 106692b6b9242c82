// When to try a lost cache rank again: at once, then a wait that doubles up to a maximum. Both
// data planes use it: the host plane's ReconnectingCacheRank (reconnecting_cache.h) and the
// device plane's DeviceCacheRankResidency (device_cache_rank_residency.h).
// Narrative: docs/disaggregated.md "Reconnecting".
#pragma once

#include <chrono>

#include "common/config.h"

namespace rubato {

struct ReconnectBackoff {
  std::chrono::milliseconds first{200};  // the wait after the first failed attempt
  std::chrono::milliseconds max{10000};  // doubling up to this
};

// What the disaggregated mode uses: the first wait limits.heartbeat_ms, doubling up to 10 s.
ReconnectBackoff ReconnectBackoffFromLimits(const LimitsSection& limits);

// The wait before the next attempt after `failed_attempts` attempts have failed since the loss:
// none before the first, then backoff.first, doubling, never more than backoff.max. What the
// watchers wait and what their log lines say.
std::chrono::milliseconds ReconnectDelay(const ReconnectBackoff& backoff, int failed_attempts);

}  // namespace rubato
