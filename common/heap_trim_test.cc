// The heap trimmer: its trigger (bytes noted since the last trim against the threshold), and on
// glibc that a trim gives back what 20 threads freed: each parses a large request into small
// pieces in its own arena, keeps a few (fragmenting the arena so that free() alone cannot
// shrink it) and frees the rest. RSS from /proc/self/statm; after the trim at most an eighth of
// what was freed may stay resident.
#include "common/heap_trim.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <thread>
#include <vector>

namespace rubato {
namespace {

TEST(HeapTrimmer, TrimsOnceTheNotedBytesPassTheThreshold) {
  int trims = 0;
  HeapTrimmer trimmer(1000, [&] { ++trims; });
  EXPECT_FALSE(trimmer.TrimIfDue());
  trimmer.NoteReleased(600);
  EXPECT_FALSE(trimmer.TrimIfDue());
  trimmer.NoteReleased(400);
  EXPECT_TRUE(trimmer.TrimIfDue());
  EXPECT_EQ(trims, 1);
  EXPECT_FALSE(trimmer.TrimIfDue()) << "the count starts again after a trim";
  trimmer.NoteReleased(5000);
  EXPECT_TRUE(trimmer.TrimIfDue());
  EXPECT_EQ(trims, 2);
}

#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
size_t RssBytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

TEST(HeapTrimmer, GivesBackWhatTwentyLargeRequestsFreed) {
  constexpr int kThreads = 20;
  constexpr size_t kPiece = 4096, kPieces = (size_t{8} << 20) / kPiece;  // 8 MiB per request
  std::vector<std::vector<std::unique_ptr<char[]>>> kept(kThreads);
  const size_t baseline = RssBytes();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&kept, t] {
      std::vector<std::unique_ptr<char[]>> pieces;
      for (size_t i = 0; i < kPieces; ++i) {
        pieces.emplace_back(new char[kPiece]);
        std::fill_n(pieces.back().get(), kPiece, static_cast<char>(i));  // touched: resident
      }
      for (size_t i = 0; i < kPieces; i += 64) kept[t].push_back(std::move(pieces[i]));
    });  // the other pieces are freed here, into this thread's arena
  }
  for (std::thread& thread : threads) thread.join();
  const size_t freed = kThreads * kPieces * kPiece * 63 / 64;
  const size_t kept_bytes = kThreads * kPieces * kPiece / 64;
  const size_t before = RssBytes();
  HeapTrimmer trimmer(1);
  trimmer.NoteReleased(freed);
  ASSERT_TRUE(trimmer.TrimIfDue());
  const size_t after = RssBytes();
  // glibc may already have returned part of the freed memory before the trim (how much depends on
  // the order the threads freed in), so the bound is on what stays after it: at most an eighth of
  // the freed bytes above the baseline and the kept pieces. Without the trim most of it stays
  // (RSS before the trim is printed to show how much).
  EXPECT_LT(after, baseline + kept_bytes + freed / 8)
      << "RSS " << (baseline >> 20) << " MiB at the start, " << (before >> 20)
      << " MiB before the trim, " << (after >> 20) << " MiB after; " << (freed >> 20)
      << " MiB were freed, " << (kept_bytes >> 20) << " MiB kept";
}
#endif

}  // namespace
}  // namespace rubato
