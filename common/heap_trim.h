// Giving freed heap memory back to the OS after large requests. glibc keeps what a thread frees
// in that thread's arena: after 100 concurrent 15 MB prompts `rubato serve` stayed at 1.85 GB
// RSS, idle, for good. Code that handled a large buffer notes its size; the serving loop, when
// idle, trims the heap (malloc_trim(0): every arena's free pages) once the noted bytes pass a
// threshold. docs/security.md "Memory returned after large requests".
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>

namespace rubato {

class HeapTrimmer {
 public:
  // 64 MiB of large buffers since the last trim make the next idle moment trim.
  static constexpr size_t kDefaultThresholdBytes = size_t{64} << 20;

  // `trim` gives memory back (default: malloc_trim(0) on glibc, nothing elsewhere).
  explicit HeapTrimmer(size_t threshold_bytes = kDefaultThresholdBytes,
                       std::function<void()> trim = nullptr);

  // A buffer of `bytes` was (or is about to be) freed. Thread-safe.
  void NoteReleased(size_t bytes);
  // Trims when the bytes noted since the last trim reach the threshold; true when it did.
  // Call where the process is idle (the trim walks every arena, milliseconds on a large heap).
  bool TrimIfDue();

  // The process's trimmer: the HTTP server notes request bodies, the serving loop trims.
  static HeapTrimmer& Process();

 private:
  size_t threshold_;
  std::function<void()> trim_;
  std::atomic<size_t> noted_{0};
};

}  // namespace rubato
