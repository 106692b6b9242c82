// SFI Selector, Eq. 24 with stage C's priorities (sfi_selector.cu launches it): SfiTopKKernel,
// one block per (sequence, KV head), selects the K = budget positions of largest rank, ascending,
// by radix select in shared memory (no global atomics): forced positions first by (c_h, z_adj),
// the others by z_adj, equal ranks to the lower position (the CPU twin's SfiTopKPositions).
// The passes: docs/sfi.md "Top-K".
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "inference_rank/policies/sfi/kernels/sfi_selector_device.cuh"

namespace rubato::cuda::sfi {

constexpr int kTopKThreads = 1024;
constexpr int kTopKWarps = kTopKThreads / 32;
constexpr int kTopKTile = 4 * kTopKThreads;  // positions per tile: 4 consecutive per thread
constexpr int kTileBatch = 2;                // tiles whose loads are in flight together
constexpr int kDigitBits = 11;
constexpr int kDigitBins = 1 << kDigitBits;  // two per thread
static_assert(kDigitBins == 2 * kTopKThreads, "the bin scan gives every thread two bins");

struct TopKShared {
  uint32_t hist[kDigitBins];
  unsigned long long warp_scan[kTopKWarps];
  unsigned long long total;
  int bin;
  uint32_t target;
};

// The sum of `value` over the threads before this one (kTopKThreads), and over the block in
// `total`. Called in uniform control flow.
__device__ __forceinline__ unsigned long long TopKExclusiveScan(unsigned long long value,
                                                                unsigned long long& total,
                                                                TopKShared& sh) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  unsigned long long inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned long long up = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) sh.warp_scan[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {  // kTopKWarps == 32: one lane per warp total
    const unsigned long long own = sh.warp_scan[lane];
    unsigned long long scan = own;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const unsigned long long up = __shfl_up_sync(kFullMask, scan, offset);
      if (lane >= offset) scan += up;
    }
    sh.warp_scan[lane] = scan - own;
    if (lane == 31) sh.total = scan;
  }
  __syncthreads();
  const unsigned long long before = sh.warp_scan[warp] + inclusive - value;
  total = sh.total;
  __syncthreads();  // warp_scan / total are free again
  return before;
}

// One row's inputs: the keys, forced bits and c_h of positions [0, n).
struct TopKRow {
  const uint32_t* keys;  // [n] OrderedKey(z_adj), 16-byte aligned, readable up to a multiple of 4
  const uint32_t* forced_bits;  // [ceil(n / 32)]
  const float* cont;            // [n] c_h where forced
  int n;
};

// Calls visit(t, e, i, rank, in_group, forced) for 4 consecutive positions per thread (e) of
// every tile (t of a batch of kTileBatch whose loads are in flight at once). rank: the 64-bit
// rank of position i (forced group: OrderedKey(c) << 32 | key; else the key); in_group: i < n and
// the position competes in the selection being made (the forced ones when kForcedGroup, the
// others else). Every thread calls visit the same number of times (warp-wide calls inside are
// allowed).
template <bool kForcedGroup, typename Visit>
__device__ __forceinline__ void ForEachRank(const TopKRow& row, Visit visit) {
  const int t4 = 4 * static_cast<int>(threadIdx.x);
  for (int base = 0; base < row.n; base += kTileBatch * kTopKTile) {
    uint4 keys[kTileBatch];
    uint32_t bits[kTileBatch];
    float4 cont[kTileBatch];
#pragma unroll
    for (int t = 0; t < kTileBatch; ++t) {
      // Clamped to the row's last whole group of 4 (inside the allocation), masked below.
      const int i0 = min(base + t * kTopKTile + t4, (row.n - 1) / 4 * 4);
      keys[t] = *reinterpret_cast<const uint4*>(row.keys + i0);
      bits[t] = row.forced_bits[i0 / 32];
      if (kForcedGroup) cont[t] = *reinterpret_cast<const float4*>(row.cont + i0);
    }
#pragma unroll
    for (int t = 0; t < kTileBatch; ++t) {
      const int i0 = base + t * kTopKTile + t4;
      const uint32_t key[4] = {keys[t].x, keys[t].y, keys[t].z, keys[t].w};
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      if (kForcedGroup) {
        c[0] = cont[t].x;
        c[1] = cont[t].y;
        c[2] = cont[t].z;
        c[3] = cont[t].w;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + e;
        const bool forced = i < row.n && ((bits[t] >> (i % 32)) & 1u);
        const bool in_group = i < row.n && forced == kForcedGroup;
        const unsigned long long rank =
            kForcedGroup ? (static_cast<unsigned long long>(OrderedKey(c[e])) << 32) | key[e]
                         : key[e];
        visit(t, e, i, rank, in_group, forced);
      }
    }
  }
}

// hist[bin] += 1 for each lane with bin >= 0: one match and one shared atomic per distinct bin of
// the warp (the lowest lane of each group of equal bins adds the group's size). Every lane of the
// warp must call it.
__device__ __forceinline__ void WarpMatchHistogramAdd(uint32_t* hist, int bin) {
  // After the first digit few ranks still match the prefix: most warps have nothing to count.
  if (!__any_sync(kFullMask, bin >= 0)) return;
  const unsigned peers = __match_any_sync(kFullMask, bin);
  if (bin >= 0 && static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1) {
    atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
  }
}

// Radix select: the rank of the `target`-th largest (1-based) member of the group, and how many
// members equal to it are kept (`target` on return). kBits: 32 or 64.
template <bool kForcedGroup, int kBits>
__device__ void RadixSelect(const TopKRow& row, uint32_t& target, unsigned long long& cut,
                            TopKShared& sh) {
  unsigned long long prefix = 0, mask = 0;
  for (int high = kBits; high > 0;) {
    const int width = high >= kDigitBits ? kDigitBits : high;
    const int shift = high - width;
    high = shift;
    const unsigned long long digit_mask = (1ull << width) - 1;
    for (int b = static_cast<int>(threadIdx.x); b < kDigitBins; b += kTopKThreads) sh.hist[b] = 0;
    if (threadIdx.x == 0) {  // unreachable fallback: the counts always reach the target
      sh.bin = 0;
      sh.target = 1;
    }
    __syncthreads();
    ForEachRank<kForcedGroup>(row, [&](int, int, int, unsigned long long rank, bool in_group,
                                       bool) {
      const bool counted = in_group && (rank & mask) == prefix;
      WarpMatchHistogramAdd(sh.hist,
                            counted ? static_cast<int>((rank >> shift) & digit_mask) : -1);
    });
    __syncthreads();
    // Bins from the top: thread t holds bins top and top − 1.
    const int top = kDigitBins - 1 - 2 * static_cast<int>(threadIdx.x);
    const uint32_t upper = sh.hist[top], lower = sh.hist[top - 1];
    unsigned long long total;
    const uint32_t before = static_cast<uint32_t>(TopKExclusiveScan(upper + lower, total, sh));
    if (before < target && before + upper >= target) {
      sh.bin = top;
      sh.target = target - before;
    } else if (before + upper < target && before + upper + lower >= target) {
      sh.bin = top - 1;
      sh.target = target - before - upper;
    }
    __syncthreads();
    prefix |= static_cast<unsigned long long>(sh.bin) << shift;
    mask |= digit_mask << shift;
    target = sh.target;
    __syncthreads();  // sh.bin / sh.target / hist are rewritten by the next digit
  }
  cut = prefix;
}

// Writes the kept positions in order (see the file comment, step 3). forced_first: F < K', so
// every forced position is kept and the cut applies to the others.
template <bool kForcedGroup>
__device__ void WriteKept(const TopKRow& row, unsigned long long cut, uint32_t ties,
                          bool forced_first, int begin, int32_t* out, TopKShared& sh) {
  constexpr unsigned long long kAbove = 1ull << 32;  // a sure keep; 1: a tie
  const int t4 = 4 * static_cast<int>(threadIdx.x);
  unsigned long long carry = 0;  // (kept above << 32) + ties before the current tile batch
  for (int base = 0; base < row.n; base += kTileBatch * kTopKTile) {
    unsigned long long flags[kTileBatch][4];
    const auto classify = [&](int t, int e, int, unsigned long long rank, bool in_group,
                              bool forced) {
      flags[t][e] = (forced_first && forced) || (in_group && rank > cut) ? kAbove
                    : in_group && rank == cut                             ? 1
                                                                          : 0;
    };
    TopKRow batch = row;  // the current batch only
    batch.keys = row.keys + base;
    batch.forced_bits = row.forced_bits + base / 32;
    batch.cont = row.cont + base;
    batch.n = min(row.n - base, kTileBatch * kTopKTile);
    // ForEachRank walks one batch; positions past batch.n come out as not in the group.
    ForEachRank<kForcedGroup>(batch, classify);
#pragma unroll
    for (int t = 0; t < kTileBatch; ++t) {
      unsigned long long local = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) local += flags[t][e];
      unsigned long long tile_total;
      unsigned long long running = carry + TopKExclusiveScan(local, tile_total, sh);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const unsigned long long above = running >> 32, tied = running & 0xffffffffull;
        if (flags[t][e] == kAbove || (flags[t][e] == 1 && tied < ties)) {
          out[above + (tied < ties ? tied : ties)] = begin + base + t * kTopKTile + t4 + e;
        }
        running += flags[t][e];
      }
      carry += tile_total;
    }
  }
}

__global__ void __launch_bounds__(kTopKThreads) SfiTopKKernel(const KernelArgs args) {
  __shared__ TopKShared sh;
  const int H = args.num_kv_heads;
  const int total_rows = args.batch * H;
  const int budget = args.config.budget;
  for (int r = blockIdx.y; r < total_rows; r += gridDim.y) {
    const AllowedSet set = LoadAllowedSet(args, r / H);
    const int n = set.count;
    int32_t* out = args.selected + static_cast<int64_t>(r) * budget;
    if (threadIdx.x == 0) args.selected_count[r] = min(budget, n);
    if (n <= budget) {  // J is selected entirely, already ascending (n == 0: nothing)
      for (int j = static_cast<int>(threadIdx.x); j < n; j += kTopKThreads) out[j] = set.begin + j;
      continue;
    }
    const int64_t offset = static_cast<int64_t>(r) * args.row_stride;
    const TopKRow row{args.keys + offset, args.forced_bits + offset / 32, args.cont + offset, n};

    // 1. F: the forced positions (words past n / 32 hold no bit past n: the scores kernel writes
    // whole words of valid positions only, and masks the last one).
    uint32_t forced = 0;
    for (int w = static_cast<int>(threadIdx.x); w < (n + 31) / 32; w += kTopKThreads) {
      uint32_t word = row.forced_bits[w];
      if (w == n / 32) word &= (1u << (n % 32)) - 1u;
      forced += __popc(word);
    }
    unsigned long long forced_total;
    TopKExclusiveScan(forced, forced_total, sh);
    const uint32_t k = static_cast<uint32_t>(budget);  // K' = K here: n > K

    // 2-3.
    unsigned long long cut;
    if (forced_total >= k) {
      uint32_t ties = k;
      RadixSelect<true, 64>(row, ties, cut, sh);
      WriteKept<true>(row, cut, ties, /*forced_first=*/false, set.begin, out, sh);
    } else {
      uint32_t ties = k - static_cast<uint32_t>(forced_total);
      RadixSelect<false, 32>(row, ties, cut, sh);
      WriteKept<false>(row, cut, ties, /*forced_first=*/true, set.begin, out, sh);
    }
    __syncthreads();  // sh is rewritten for the next row
  }
}

}  // namespace rubato::cuda::sfi
