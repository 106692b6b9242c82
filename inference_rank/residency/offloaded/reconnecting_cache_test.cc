// ReconnectDelay, the watcher's schedule after a lost cache rank: the first attempt at once, then
// backoff.first doubling up to backoff.max (what the watcher waits and what its log line names).
// The reconnects themselves, through the binaries: tests/serve_reconnect_test.cc.
#include "inference_rank/residency/offloaded/reconnecting_cache.h"

#include <gtest/gtest.h>

#include <chrono>
#include <climits>

namespace rubato {
namespace {

using std::chrono::milliseconds;

TEST(ReconnectDelay, TheFirstAttemptIsAtOnceThenTheBackoffDoublesUpToItsMax) {
  const ReconnectBackoff backoff{milliseconds(1000), milliseconds(10000)};
  EXPECT_EQ(ReconnectDelay(backoff, 0), milliseconds(0));
  EXPECT_EQ(ReconnectDelay(backoff, 1), milliseconds(1000));
  EXPECT_EQ(ReconnectDelay(backoff, 2), milliseconds(2000));
  EXPECT_EQ(ReconnectDelay(backoff, 3), milliseconds(4000));
  EXPECT_EQ(ReconnectDelay(backoff, 4), milliseconds(8000));
  EXPECT_EQ(ReconnectDelay(backoff, 5), milliseconds(10000));  // 16000 capped: what is waited
  EXPECT_EQ(ReconnectDelay(backoff, 6), milliseconds(10000));
  EXPECT_EQ(ReconnectDelay(backoff, INT_MAX), milliseconds(10000));  // no overflow
}

TEST(ReconnectDelay, AFirstWaitOverTheMaxIsTheMax) {
  const ReconnectBackoff backoff{milliseconds(20000), milliseconds(10000)};
  EXPECT_EQ(ReconnectDelay(backoff, 0), milliseconds(0));
  EXPECT_EQ(ReconnectDelay(backoff, 1), milliseconds(10000));
  EXPECT_EQ(ReconnectDelay(backoff, 3), milliseconds(10000));
}

}  // namespace
}  // namespace rubato
