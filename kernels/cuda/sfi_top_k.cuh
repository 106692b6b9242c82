// SFI Selector, kernel 3 of 3 (sfi_selector.cu launches it): Eq. 24, the K = budget positions of
// largest z_adj for one (sequence, KV head), ascending, ties to the lower position (the CPU
// twin's SfiTopKPositions).
//
// One block of kThreads threads per (sequence, KV head). |J| <= K selects all of J. Otherwise:
//   1. radix select: the scores as order-preserving u32 keys, 8 bits per pass from the top
//      (4 passes); each pass histograms the keys that match the prefix found so far by their next
//      digit (warp-aggregated shared atomics: __match_any_sync, since most scores share their top
//      bits) and walks the bins from the highest to the one holding the K-th key. The result is
//      the K-th largest key exactly, `above` keys larger than it and K − above to take from the
//      keys equal to it;
//   2. compaction in position order: a block-wide scan over (above, tied) counts; a position is
//      kept if its key is larger, or equal and among the first K − above equal ones. Its output
//      slot is the number of kept positions before it, so the output is ascending at once and
//      ties go to the lower positions.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/sfi_selector_device.cuh"

namespace rubato::cuda::sfi {

constexpr int kTopKPerThread = 4;  // consecutive positions per thread and tile
constexpr int kTopKTile = kTopKPerThread * kThreads;
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerLane = kBins / 32;
constexpr int kNoBin = kBins;  // a lane with no key to count this pass

// a > b  <=>  OrderedKey(a) > OrderedKey(b) for non-NaN floats (z_adj is never NaN); -0 maps like
// +0 because the CPU compares values.
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) == 0) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct TopKShared {
  unsigned hist[kBins];
  unsigned long long scan[kWarps];  // BlockExclusiveScan scratch
  int found_bin;
  unsigned found_before;  // keys with the prefix in bins above found_bin
};

// Block blockIdx.x = sequence * num_kv_heads + kv_head.
__global__ void __launch_bounds__(kThreads) SfiTopKKernel(const KernelArgs args) {
  __shared__ TopKShared sh;
  const int row = static_cast<int>(blockIdx.x);
  const AllowedSet set = LoadAllowedSet(args, row / args.num_kv_heads);
  const int n = set.count;
  const int budget = args.config.budget;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  int32_t* out = args.selected + static_cast<int64_t>(row) * budget;
  if (tid == 0) args.selected_count[row] = min(budget, n);
  if (n <= budget) {  // the whole block: J is selected entirely, already ascending
    for (int i = tid; i < n; i += kThreads) out[i] = set.begin + i;
    return;
  }
  const float* scores = WorkspaceRow(args.z, args, row);  // z_adj, kernel 2

  // ---- 1. radix select of the budget-th largest key ------------------------------------------
  uint32_t prefix = 0, mask = 0;
  // The rank sought among the keys with the prefix; at the end, how many keys equal to the K-th
  // are kept (K minus the keys above it).
  unsigned target = static_cast<unsigned>(budget);
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int i = tid; i < kBins; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += kTopKTile) {
#pragma unroll
      for (int e = 0; e < kTopKPerThread; ++e) {
        const int k = base + kTopKPerThread * tid + e;
        int bin = kNoBin;
        if (k < n) {
          const uint32_t key = OrderedKey(scores[k]);
          if ((key & mask) == prefix) bin = static_cast<int>((key >> shift) & (kBins - 1));
        }
        // Every lane of the warp gets here (the loop bounds are uniform): aggregate equal bins.
        const unsigned peers = __match_any_sync(kFullMask, bin);
        if (bin != kNoBin && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bin], __popc(peers));
      }
    }
    __syncthreads();
    if (tid < 32) {
      if (tid == 0) {  // unreachable fallback: the keys with the prefix number >= target
        sh.found_bin = 0;
        sh.found_before = 0;
      }
      __syncwarp();
      // Lane l walks bins kBins-1-8l down to kBins-8-8l: the warp walks every bin from the top.
      unsigned local = 0;
      for (int r = 0; r < kBinsPerLane; ++r) local += sh.hist[kBins - 1 - (tid * kBinsPerLane + r)];
      unsigned inclusive = local;
      for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned up = __shfl_up_sync(kFullMask, inclusive, offset);
        if (tid >= offset) inclusive += up;
      }
      unsigned running = inclusive - local;
      for (int r = 0; r < kBinsPerLane; ++r) {
        const int bin = kBins - 1 - (tid * kBinsPerLane + r);
        const unsigned count = sh.hist[bin];
        // Exactly one bin: the counts are exact and the keys with the prefix number >= target.
        if (running < target && running + count >= target) {
          sh.found_bin = bin;
          sh.found_before = running;
        }
        running += count;
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(sh.found_bin) << shift;
    mask |= static_cast<uint32_t>(kBins - 1) << shift;
    target -= sh.found_before;
    // No barrier needed before the next pass clears hist: warp 0 read it before the one above,
    // and found_* are rewritten only after the next pass's barriers.
  }
  const uint32_t cut = prefix;                  // the budget-th largest key
  const unsigned long long ties_kept = target;  // >= 1 keys equal to cut, lowest positions

  // ---- 2. compaction in position order --------------------------------------------------------
  constexpr unsigned long long kAbove = 1ull << 32;  // counts packed (above << 32) | tied
  unsigned long long carry = 0;
  for (int base = 0; base < n; base += kTopKTile) {
    const int k0 = base + kTopKPerThread * tid;
    unsigned long long flag[kTopKPerThread], local = 0;
#pragma unroll
    for (int e = 0; e < kTopKPerThread; ++e) {
      const int k = k0 + e;
      flag[e] = 0;
      if (k < n) {
        const uint32_t key = OrderedKey(scores[k]);
        flag[e] = key > cut ? kAbove : key == cut ? 1 : 0;
      }
      local += flag[e];
    }
    unsigned long long tile_total;
    unsigned long long running = carry + BlockExclusiveScan(local, tile_total, sh.scan);
#pragma unroll
    for (int e = 0; e < kTopKPerThread; ++e) {
      const unsigned long long larger = running >> 32, tied = running & 0xffffffffull;
      if (flag[e] == kAbove || (flag[e] == 1 && tied < ties_kept)) {
        out[larger + (tied < ties_kept ? tied : ties_kept)] = set.begin + k0 + e;
      }
      running += flag[e];
    }
    carry += tile_total;
  }
}

}  // namespace rubato::cuda::sfi
