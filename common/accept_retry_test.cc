// AcceptRetry: the delays double from 10 ms to a 1 s cap and reset on success; a log line at most
// once per 10 s carries the failures since the previous one.
#include "common/accept_retry.h"

#include <gtest/gtest.h>

namespace rubato {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(AcceptRetry, DelaysDoubleToTheCapAndResetOnSuccess) {
  AcceptRetry retry;
  const auto now = std::chrono::steady_clock::now();
  const int expected[] = {10, 20, 40, 80, 160, 320, 640, 1000, 1000};
  for (int ms : expected) EXPECT_EQ(retry.OnFailure(now).delay, milliseconds(ms));
  retry.OnSuccess();
  EXPECT_EQ(retry.OnFailure(now).delay, milliseconds(10));
}

TEST(AcceptRetry, LogsTheFirstFailureThenAtMostOncePerIntervalWithTheCount) {
  AcceptRetry retry;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(retry.OnFailure(start).log_count, 1);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(retry.OnFailure(start + seconds(1)).log_count, 0);
  EXPECT_EQ(retry.OnFailure(start + seconds(10)).log_count, 6);
  EXPECT_EQ(retry.OnFailure(start + seconds(11)).log_count, 0);
}

}  // namespace
}  // namespace rubato
