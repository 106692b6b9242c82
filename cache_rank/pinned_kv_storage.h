// Pinned (page-locked) host memory for the cache rank's KV (docs/design.md §1, the cache
// rank's "full KV store"): the same host-addressable storage as MakeHostKvStorageAllocator,
// allocated with cudaHostAlloc so that a GPU can read and write it by DMA at full PCIe / C2C
// bandwidth (the copies of a cache rank that feeds a GPU, or a GPU transport's staging). Built in
// CUDA builds only (RUBATO_HAS_CUDA_PINNED); on a machine without a GPU driver Allocate fails with
// kUnavailable, naming CUDA's error.
#pragma once

#include <memory>

#include "cache_rank/kv_storage.h"

namespace rubato {

// Allocations make `device` current on the allocating thread (the cache rank's GPU, whose
// context the pinned memory belongs to).
std::shared_ptr<KvStorageAllocator> MakePinnedKvStorageAllocator(int device = 0);

}  // namespace rubato
