// The heap trimmer (see heap_trim.h).
#include "common/heap_trim.h"

#include <utility>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace rubato {

namespace {

void TrimMalloc() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace

HeapTrimmer::HeapTrimmer(size_t threshold_bytes, std::function<void()> trim)
    : threshold_(threshold_bytes), trim_(trim ? std::move(trim) : TrimMalloc) {}

void HeapTrimmer::NoteReleased(size_t bytes) { noted_.fetch_add(bytes, std::memory_order_relaxed); }

bool HeapTrimmer::TrimIfDue() {
  if (noted_.load(std::memory_order_relaxed) < threshold_) return false;
  noted_.store(0, std::memory_order_relaxed);
  trim_();
  return true;
}

HeapTrimmer& HeapTrimmer::Process() {
  static HeapTrimmer trimmer;
  return trimmer;
}

}  // namespace rubato
