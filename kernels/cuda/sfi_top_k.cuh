// SFI Selector, Eq. 24 with stage C's priorities (sfi_selector.cu launches these): the K =
// budget positions of largest rank key of every (sequence, KV head), ascending, ties to the lower
// position (the CPU twin's SfiTopKPositions). A rank key is kForcedKey at a position stage C
// forces, else OrderedKey(z_adj) (sfi_cross_head.cuh, which also histograms the first digit).
//
// Multi-block radix select over chunks of kChunk positions, grid (chunk, row), no grid-wide sync:
// every kernel reads the complete histogram of the previous one.
//   SfiRadixKernel<1>  picks the digit-1 bin (bits 31..24) holding the K-th largest key, then
//                      histograms bits 23..12 of the keys in that bin (in shared memory, then one
//                      global atomic per nonzero bin);
//   SfiRadixKernel<2>  picks the digit-2 bin, then histograms bits 11..0 of the keys with that
//                      20-bit prefix;
//   SfiRadixKernel<3>  picks the digit-3 bin: the K-th largest key `cut` exactly and how many
//                      keys equal to it are kept (K minus the keys above it); counts per chunk
//                      the keys above and equal to the cut;
//   SfiWriteSelectionKernel  compaction in position order: a position is kept if its key is
//                      above the cut, or equal and among the first kept-ties equal ones; its slot
//                      is the number of kept positions before it (earlier chunks' counts plus a
//                      block-wide scan), so the output is ascending at once.
// The chunk-0 block of a row stores each step's (prefix, rank left) for the next kernel.
// When |J| <= K the whole of J is written. When stage C forces more than K positions the order
// among them matters ((c, z_adj, position)), and the chunk-0 block of SfiWriteSelectionKernel
// selects among the forced positions alone with 64-bit keys (OrderedKey(c) << 32) | key, in one
// block (such rows are rare: at most (C + 1) / threshold forced positions, 900 by default).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/sfi_selector_device.cuh"

namespace rubato::cuda::sfi {

constexpr int kRanksPerLoad = 4;  // consecutive positions per thread and load (one uint4)
constexpr int kLoadsPerChunk = kChunk / (kRanksPerLoad * kThreads);  // 4
constexpr int kScanTile = kRanksPerLoad * kThreads;                   // positions per scan step

struct BinChoice {
  int bin;
  uint32_t target;  // the rank sought within the chosen bin
};

struct TopKShared {
  uint32_t scan32[kWarps];
  unsigned long long scan64[kWarps];
  uint32_t hist[256];  // the forced-position select's digit histogram
  BinChoice choice;
};

// The bin of hist[0, kBins) (kBins = kThreads * per) that holds the `target`-th largest key
// (counting the bins from the top), and the rank left inside it. Every thread gets it. Each
// thread loads its bins once (unrolled: the loads overlap).
template <int kBins>
__device__ BinChoice SelectBin(const uint32_t* hist, uint32_t target, TopKShared& sh) {
  constexpr int kPer = kBins / kThreads;
  static_assert(kPer * kThreads == kBins, "whole bins per thread");
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) sh.choice = {0, 1};  // unreachable fallback: the counts always reach target
  uint32_t counts[kPer];
  uint32_t local = 0;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    counts[q] = hist[kBins - 1 - (tid * kPer + q)];
    local += counts[q];
  }
  uint32_t total;
  uint32_t running = BlockExclusiveScan(local, total, sh.scan32);  // its barriers order choice
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    if (running < target && running + counts[q] >= target) {
      sh.choice = {kBins - 1 - (tid * kPer + q), target - running};
    }
    running += counts[q];
  }
  __syncthreads();
  const BinChoice choice = sh.choice;
  __syncthreads();
  return choice;
}

// Rank keys of positions base .. base + 3 (base a multiple of 4, < n); valid[e] = base + e < n.
__device__ __forceinline__ void LoadRanks(const KernelArgs& args, int row, int n, int base,
                                          uint32_t rank[kRanksPerLoad]) {
  const int64_t offset = static_cast<int64_t>(row) * args.row_stride;
  const uint4 keys = *reinterpret_cast<const uint4*>(args.keys + offset + base);
  const uint32_t bits =
      args.forced_bits[static_cast<int64_t>(row) * (args.row_stride / 32) + base / 32];
  const uint32_t raw[kRanksPerLoad] = {keys.x, keys.y, keys.z, keys.w};
#pragma unroll
  for (int e = 0; e < kRanksPerLoad; ++e) {
    rank[e] = (bits >> ((base + e) % 32)) & 1u ? kForcedKey : raw[e];
  }
}

// Rows whose selection the radix kernels compute: more positions than K, at most K forced.
__device__ __forceinline__ bool RadixRow(const KernelArgs& args, int row, int n) {
  return n > args.config.budget &&
         args.forced_count[row] <= static_cast<uint32_t>(args.config.budget);
}

template <int kStep>
__global__ void __launch_bounds__(kThreads) SfiRadixKernel(const KernelArgs args) {
  __shared__ TopKShared sh;
  __shared__ uint32_t digit_hist[kBins2];  // this block's counts of the next digit
  static_assert(kBins2 == kBins3, "one shared histogram serves both refining digits");
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = static_cast<int>(blockIdx.x);
  const int H = args.num_kv_heads;
  const int total_rows = args.batch * H;
  for (int row = blockIdx.y; row < total_rows; row += gridDim.y) {
    const AllowedSet set = LoadAllowedSet(args, row / H);
    const int n = set.count;
    const int c0 = chunk * kChunk;
    if (c0 >= n || !RadixRow(args, row, n)) continue;  // uniform over the block
    uint32_t* hist = args.hist + static_cast<int64_t>(row) * kHistWords;
    SelectState* state = args.select_state + static_cast<int64_t>(row) * 3;
    // This step's digit: the bin of the previous histogram that holds the rank left.
    SelectState prev{0, static_cast<uint32_t>(args.config.budget)};
    if (kStep > 1) prev = state[kStep - 2];
    const uint32_t* hist_in = hist + (kStep == 1 ? 0 : kStep == 2 ? kBins1 : kBins1 + kBins2);
    const BinChoice choice = kStep == 1 ? SelectBin<kBins1>(hist_in, prev.target, sh)
                                        : SelectBin<kBins2>(hist_in, prev.target, sh);
    const int digit_bits = kStep == 1 ? kBits1 : kStep == 2 ? kBits2 : kBits3;
    const uint32_t prefix = (prev.prefix << digit_bits) | static_cast<uint32_t>(choice.bin);
    if (chunk == 0 && tid == 0) state[kStep - 1] = {prefix, choice.target};
    if (kStep < 3) {
      for (int i = tid; i < kBins2; i += kThreads) digit_hist[i] = 0;
      __syncthreads();
    }

    // kStep 1: prefix = bits 31..24, count bits 23..12; kStep 2: prefix = bits 31..12, count
    // bits 11..0; kStep 3: prefix = the cut, count the keys above and equal to it.
    const int shift = kStep == 1 ? 32 - kBits1 : kBits3;  // bits below the prefix
    uint32_t above = 0, tied = 0;
    for (int k = 0; k < kLoadsPerChunk; ++k) {
      const int base = c0 + kRanksPerLoad * (k * kThreads + tid);
      if (base >= n) break;
      uint32_t rank[kRanksPerLoad];
      LoadRanks(args, row, n, base, rank);
#pragma unroll
      for (int e = 0; e < kRanksPerLoad; ++e) {
        if (base + e >= n) break;
        if (kStep == 3) {
          above += rank[e] > prefix;
          tied += rank[e] == prefix;
        } else if ((rank[e] >> shift) == prefix) {
          const uint32_t bin = kStep == 1 ? (rank[e] >> kBits3) & (kBins2 - 1) : rank[e] & (kBins3 - 1);
          atomicAdd(&digit_hist[bin], 1u);
        }
      }
    }
    if (kStep == 3) {
      above = BlockReduce(above, SumOp{}, sh.scan32);
      tied = BlockReduce(tied, SumOp{}, sh.scan32);
      if (tid == 0) {
        args.chunk_counts[static_cast<int64_t>(row) * args.num_chunks + chunk] = {above, tied};
      }
    } else {
      __syncthreads();
      uint32_t* hist_out = hist + (kStep == 1 ? kBins1 : kBins1 + kBins2);
      for (int i = tid; i < kBins2; i += kThreads) {
        if (digit_hist[i] != 0) atomicAdd(&hist_out[i], digit_hist[i]);
      }
      __syncthreads();  // digit_hist is cleared for the next row
    }
  }
}

// Writes out[slot] = position for the kept positions among [first, first + count) in position
// order, 4 consecutive per thread; flag(i, e) gives position i's class (kAbove: kept, 1: equal
// to the cut, kept among the first ties_kept, 0: not kept). carry = (kept above before first
// << 32) | (ties before first).
constexpr unsigned long long kAbove = 1ull << 32;

template <typename Flag>
__device__ void CompactInOrder(Flag flag, int first, int count, unsigned long long carry,
                               unsigned long long ties_kept, int begin, int32_t* out,
                               TopKShared& sh) {
  for (int base = first; base < first + count; base += kScanTile) {
    const int k0 = base + kRanksPerLoad * static_cast<int>(threadIdx.x);
    unsigned long long flags[kRanksPerLoad], local = 0;
    flag(k0, flags);  // zeros past first + count
#pragma unroll
    for (int e = 0; e < kRanksPerLoad; ++e) local += flags[e];
    unsigned long long tile_total;
    unsigned long long running = carry + BlockExclusiveScan(local, tile_total, sh.scan64);
#pragma unroll
    for (int e = 0; e < kRanksPerLoad; ++e) {
      const unsigned long long larger = running >> 32, tied = running & 0xffffffffull;
      if (flags[e] == kAbove || (flags[e] == 1 && tied < ties_kept)) {
        out[larger + (tied < ties_kept ? tied : ties_kept)] = begin + k0 + e;
      }
      running += flags[e];
    }
    carry += tile_total;
  }
}

// One block: the top-K of the forced positions of `row` by (c, z_adj), lower positions first on
// equal keys; radix select over 64-bit keys, 8 bits a pass.
__device__ void SelectAmongForced(const KernelArgs& args, int row, AllowedSet set, int32_t* out,
                                  TopKShared& sh) {
  const int n = set.count;
  const int64_t offset = static_cast<int64_t>(row) * args.row_stride;
  const uint32_t* bits = args.forced_bits + static_cast<int64_t>(row) * (args.row_stride / 32);
  const auto forced = [&](int i) { return (bits[i / 32] >> (i % 32)) & 1u; };
  const auto key64 = [&](int i) {
    return (static_cast<unsigned long long>(OrderedKey(args.cont[offset + i])) << 32) |
           args.keys[offset + i];
  };
  unsigned long long prefix = 0, mask = 0;
  uint32_t target = static_cast<uint32_t>(args.config.budget);
  for (int shift = 56; shift >= 0; shift -= 8) {
    sh.hist[threadIdx.x] = 0;  // kThreads == 256 bins
    __syncthreads();
    for (int base = 0; base < n; base += kThreads) {  // uniform trip count for the warp calls
      const int i = base + static_cast<int>(threadIdx.x);
      int bin = -1;
      if (i < n && forced(i)) {
        const unsigned long long key = key64(i);
        if ((key & mask) == prefix) bin = static_cast<int>((key >> shift) & 255);
      }
      WarpHistogramAdd(sh.hist, bin);
    }
    __syncthreads();
    const BinChoice choice = SelectBin<256>(sh.hist, target, sh);
    prefix |= static_cast<unsigned long long>(choice.bin) << shift;
    mask |= 255ull << shift;
    target = choice.target;
  }
  const unsigned long long cut = prefix;
  const auto flag = [&](int k0, unsigned long long flags[kRanksPerLoad]) {
#pragma unroll
    for (int e = 0; e < kRanksPerLoad; ++e) {
      const int i = k0 + e;
      flags[e] = 0;
      if (i < n && forced(i)) {
        const unsigned long long key = key64(i);
        flags[e] = key > cut ? kAbove : key == cut ? 1 : 0;
      }
    }
  };
  CompactInOrder(flag, 0, n, 0, target, set.begin, out, sh);
}

__global__ void __launch_bounds__(kThreads) SfiWriteSelectionKernel(const KernelArgs args) {
  __shared__ TopKShared sh;
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = static_cast<int>(blockIdx.x);
  const int H = args.num_kv_heads;
  const int total_rows = args.batch * H;
  const int budget = args.config.budget;
  for (int row = blockIdx.y; row < total_rows; row += gridDim.y) {
    const AllowedSet set = LoadAllowedSet(args, row / H);
    const int n = set.count;
    int32_t* out = args.selected + static_cast<int64_t>(row) * budget;
    if (chunk == 0 && tid == 0) args.selected_count[row] = min(budget, n);
    const int c0 = chunk * kChunk;
    if (c0 >= n) continue;  // also n == 0: nothing else is read
    const int c1 = min(c0 + kChunk, n);
    if (n <= budget) {  // J is selected entirely, already ascending
      for (int j = c0 + tid; j < c1; j += kThreads) out[j] = set.begin + j;
      continue;
    }
    if (args.forced_count[row] > static_cast<uint32_t>(budget)) {
      if (chunk == 0) SelectAmongForced(args, row, set, out, sh);
      continue;
    }
    const SelectState cut = args.select_state[static_cast<int64_t>(row) * 3 + 2];
    // Kept positions before this chunk: all keys above the cut, the ties counted separately.
    const uint2* counts = args.chunk_counts + static_cast<int64_t>(row) * args.num_chunks;
    unsigned long long before = 0;
    for (int k = tid; k < chunk; k += kThreads) {
      before += (static_cast<unsigned long long>(counts[k].x) << 32) + counts[k].y;
    }
    before = BlockReduce(before, SumOp{}, sh.scan64);
    const auto flag = [&](int k0, unsigned long long flags[kRanksPerLoad]) {
      uint32_t rank[kRanksPerLoad] = {0, 0, 0, 0};
      if (k0 < c1) LoadRanks(args, row, n, k0, rank);
#pragma unroll
      for (int e = 0; e < kRanksPerLoad; ++e) {
        flags[e] = 0;
        if (k0 + e < c1) flags[e] = rank[e] > cut.prefix ? kAbove : rank[e] == cut.prefix ? 1 : 0;
      }
    };
    CompactInOrder(flag, c0, c1 - c0, before, cut.target, set.begin, out, sh);
  }
}

}  // namespace rubato::cuda::sfi
