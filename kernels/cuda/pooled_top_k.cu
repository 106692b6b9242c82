// Pooled top-k (pooled_top_k.cuh): kernels, launcher, validation. Three launches per call:
//   1. HeadStatsKernel, grid (chunks, rows): for every query head and chunk of kChunk candidates,
//      the max score and the sum of exp2(score - max) (partial softmax statistics). Skipped when
//      the caller gives each head's log-sum-exp (head_lse: the attention pass computed it).
//   2. PooledKeysKernel, same grid: merges each head's partials into its softmax, then writes
//      every candidate's pooled score as an order-preserving 32-bit key.
//   3. SelectKernel, one block per row: a radix select over the row's keys (digits of 11, 11 and
//      10 bits) finds the k-th largest key and how many keys equal to it are kept; one pass in
//      position order then writes the kept positions, ascending.
// The first two spread the reading of the scores (group x count floats per row) over many blocks;
// the third reads only the row's keys, which the second just wrote (mostly still in L2).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/pooled_top_k.cuh"

namespace rubato::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxGridY = 65535;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2eF = 1.4426950408889634f;
// Query heads per KV head: kernel 2 keeps one (max, weight) pair per head in shared memory.
constexpr int kMaxGroup = 4096;
// Candidates per row: keeps every index sum in the kernels inside int.
constexpr int kMaxCount = 1 << 30;

// Kernels 1 and 2: each thread takes kItems candidates of the chunk, kScoreThreads apart.
constexpr int kScoreThreads = 256;
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kItems = 8;
constexpr int kChunk = kScoreThreads * kItems;

// Kernel 3: the block walks the row's keys in batches, kKeysPerThread consecutive keys per
// thread, loaded together (one L2 round trip per batch rather than per key).
constexpr int kSelectThreads = 1024;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kKeysPerThread = 8;
constexpr int kBatch = kKeysPerThread * kSelectThreads;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
static_assert(kBins == 2 * kSelectThreads, "the bin search gives every thread two bins");

// The workspace: keys [rows][key_stride] (uint32, rows 16-byte aligned), then stats
// [batch * num_heads][chunks] (float2: a head's (max, sum) over one chunk), each 256-aligned.
struct Layout {
  int64_t key_stride = 0;  // max_count rounded up to 4
  int chunks = 0;          // ceil(max_count / kChunk)
  size_t keys_bytes = 0;
  size_t stats_bytes = 0;
};

size_t AlignUp256(size_t bytes) { return (bytes + 255) / 256 * 256; }

Layout MakeLayout(int batch, int num_heads, int num_kv_heads, int max_count) {
  Layout layout;
  if (batch <= 0 || num_heads <= 0 || num_kv_heads <= 0 || max_count <= 0) return layout;
  layout.key_stride = (static_cast<int64_t>(max_count) + 3) / 4 * 4;
  layout.chunks = static_cast<int>((static_cast<int64_t>(max_count) + kChunk - 1) / kChunk);
  layout.keys_bytes =
      AlignUp256(static_cast<size_t>(batch) * num_kv_heads * layout.key_stride * sizeof(uint32_t));
  layout.stats_bytes =
      AlignUp256(static_cast<size_t>(batch) * num_heads * layout.chunks * sizeof(float2));
  return layout;
}

// What the kernels see of the workspace.
struct Workspace {
  uint32_t* keys;  // [rows][key_stride]: OrderedKey(pooled score) of candidate i at index i
  float2* stats;   // [batch * num_heads][chunks]
  int64_t key_stride;
  int chunks;
};

// ---- device helpers ---------------------------------------------------------------------------

// A row's candidates, clamped so that they lie inside the scores rows.
struct Candidates {
  int begin;
  int count;
};

__device__ __forceinline__ Candidates LoadCandidates(const PooledTopKParams& p, int sequence) {
  const int begin = max(p.begin[sequence], 0);
  const int64_t room = p.scores_stride - begin;  // may be negative: no candidate
  const int count = min(max(p.count[sequence], 0), p.max_count);
  return {begin, static_cast<int>(max(min(static_cast<int64_t>(count), room), int64_t{0}))};
}

__device__ __forceinline__ float FiniteOrMinusInf(float x) { return isfinite(x) ? x : kMinusInf; }

// Softmax statistics (max, sum of exp2(x - max)) of two sets merged; max -inf: an empty set.
__device__ __forceinline__ float2 MergeStats(float2 a, float2 b) {
  const float m = fmaxf(a.x, b.x);
  if (m == kMinusInf) return make_float2(kMinusInf, 0.f);
  return make_float2(m, a.y * exp2f(a.x - m) + b.y * exp2f(b.x - m));
}

__device__ __forceinline__ float2 WarpMergeStats(float2 s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float2 other = make_float2(__shfl_xor_sync(kFullMask, s.x, offset),
                                     __shfl_xor_sync(kFullMask, s.y, offset));
    s = MergeStats(s, other);
  }
  return s;
}

// a > b  <=>  OrderedKey(a) > OrderedKey(b) for non-NaN floats; -0 maps like +0.
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) == 0) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Positions kept for sequence b: p.k, or row_k[b] clamped to [0, p.k] when set.
__device__ __forceinline__ int RowK(const PooledTopKParams& p, int b) {
  return p.row_k == nullptr ? p.k : min(max(p.row_k[b], 0), p.k);
}

// ---- kernels 1 and 2: scoring -----------------------------------------------------------------

// Chunk blockIdx.x of every row blockIdx.y, blockIdx.y + gridDim.y, ...: per query head j of the
// row's group, stats[head][chunk] = (max, sum of exp2(score - max)) over the chunk's candidates.
__global__ void __launch_bounds__(kScoreThreads)
    HeadStatsKernel(const PooledTopKParams p, const Workspace w) {
  __shared__ float2 warp_stats[kScoreWarps];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int group = p.num_heads / p.num_kv_heads;
  const int rows = p.batch * p.num_kv_heads;
  const int chunk_begin = static_cast<int>(blockIdx.x) * kChunk;
  for (int r = static_cast<int>(blockIdx.y); r < rows; r += static_cast<int>(gridDim.y)) {
    const Candidates c = LoadCandidates(p, r / p.num_kv_heads);
    if (c.count <= RowK(p, r / p.num_kv_heads) || chunk_begin >= c.count)
      continue;  // kept whole, or past the row
    const int valid = min(kChunk, c.count - chunk_begin);
    for (int j = 0; j < group; ++j) {
      const int64_t head = static_cast<int64_t>(r) * group + j;
      const float* row = p.scores + head * p.scores_stride + c.begin + chunk_begin;
      float v[kItems];
      float m = kMinusInf;
#pragma unroll
      for (int e = 0; e < kItems; ++e) {
        const int i = e * kScoreThreads + static_cast<int>(threadIdx.x);
        v[e] = i < valid ? FiniteOrMinusInf(row[i]) : kMinusInf;
        m = fmaxf(m, v[e]);
      }
      float sum = 0.f;
      if (m != kMinusInf) {
#pragma unroll
        for (int e = 0; e < kItems; ++e) sum += exp2f(v[e] - m);
      }
      float2 s = WarpMergeStats(make_float2(m, sum));
      if (lane == 0) warp_stats[warp] = s;
      __syncthreads();
      if (warp == 0) {
        s = WarpMergeStats(lane < kScoreWarps ? warp_stats[lane] : make_float2(kMinusInf, 0.f));
        if (lane == 0) w.stats[head * w.chunks + blockIdx.x] = s;
      }
      __syncthreads();  // warp_stats is rewritten for the next head
    }
  }
}

// Same grid: each head's softmax from its partials (max, weight = 1 / (sum * group)), then for
// every candidate of the chunk keys[i] = OrderedKey(sum over heads of exp2(score - max) * weight)
// (in head order, like the CPU twin). Keys between count and the next multiple of 4 are set to 0
// (kernel 3 loads whole groups of 4 and ignores them).
__global__ void __launch_bounds__(kScoreThreads)
    PooledKeysKernel(const PooledTopKParams p, const Workspace w) {
  // [group]: (max, weight) of each head; (0, 0) for a head with no finite score, whose
  // exp2(-inf - 0) * 0 adds nothing.
  extern __shared__ float2 head_softmax[];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int group = p.num_heads / p.num_kv_heads;
  const int rows = p.batch * p.num_kv_heads;
  const int chunk_begin = static_cast<int>(blockIdx.x) * kChunk;
  for (int r = static_cast<int>(blockIdx.y); r < rows; r += static_cast<int>(gridDim.y)) {
    const Candidates c = LoadCandidates(p, r / p.num_kv_heads);
    if (c.count <= RowK(p, r / p.num_kv_heads) || chunk_begin >= c.count) continue;
    const int chunks = (c.count + kChunk - 1) / kChunk;
    for (int j = warp; j < group; j += kScoreWarps) {
      const int64_t head = static_cast<int64_t>(r) * group + j;
      if (p.pooled_input) {  // group 1: the scores are the pooled values
        if (lane == 0) head_softmax[j] = make_float2(0.f, 1.f);
        continue;
      }
      if (p.head_lse != nullptr) {  // exp2(score - lse2) is the head's probability
        if (lane == 0) {
          const float lse2 = p.head_lse[head] * kLog2eF;
          head_softmax[j] = isfinite(lse2) ? make_float2(lse2, 1.f / group) : make_float2(0.f, 0.f);
        }
        continue;
      }
      float2 s = make_float2(kMinusInf, 0.f);
      for (int chunk = lane; chunk < chunks; chunk += 32) {
        s = MergeStats(s, w.stats[head * w.chunks + chunk]);
      }
      s = WarpMergeStats(s);
      if (lane == 0) {
        head_softmax[j] =
            s.x == kMinusInf ? make_float2(0.f, 0.f) : make_float2(s.x, 1.f / (s.y * group));
      }
    }
    __syncthreads();
    const int valid = min(kChunk, c.count - chunk_begin);
    float pooled[kItems] = {};
    for (int j = 0; j < group; ++j) {
      const float2 softmax = head_softmax[j];
      const float* row = p.scores + (static_cast<int64_t>(r) * group + j) * p.scores_stride +
                         c.begin + chunk_begin;
#pragma unroll
      for (int e = 0; e < kItems; ++e) {
        const int i = e * kScoreThreads + static_cast<int>(threadIdx.x);
        if (i >= valid) continue;
        if (p.pooled_input) {
          pooled[e] = isnan(row[i]) ? kMinusInf : row[i];
        } else {
          pooled[e] += exp2f(FiniteOrMinusInf(row[i]) - softmax.x) * softmax.y;
        }
      }
    }
    uint32_t* keys = w.keys + r * w.key_stride + chunk_begin;
    const int padded = min(kChunk, (c.count + 3) / 4 * 4 - chunk_begin);
#pragma unroll
    for (int e = 0; e < kItems; ++e) {
      const int i = e * kScoreThreads + static_cast<int>(threadIdx.x);
      if (i < valid) {
        keys[i] = OrderedKey(pooled[e]);
      } else if (i < padded) {
        keys[i] = 0;
      }
    }
    __syncthreads();  // head_softmax is rewritten for the next row
  }
}

// ---- kernel 3: selection ----------------------------------------------------------------------

struct SelectShared {
  uint32_t hist[kBins];
  unsigned long long warp_sums[kSelectWarps];
  unsigned long long total;
  uint32_t bin;
  uint32_t target;
};

// The sum of `value` over the block's threads before this one, and over the block in `total`.
// Called by every thread of the block.
__device__ unsigned long long BlockExclusiveSum(unsigned long long value, unsigned long long& total,
                                                SelectShared& sh) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  unsigned long long inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned long long up = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) sh.warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {  // kSelectWarps == 32: one lane per warp
    const unsigned long long own = sh.warp_sums[lane];
    unsigned long long scan = own;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const unsigned long long up = __shfl_up_sync(kFullMask, scan, offset);
      if (lane >= offset) scan += up;
    }
    sh.warp_sums[lane] = scan - own;
    if (lane == 31) sh.total = scan;
  }
  __syncthreads();
  const unsigned long long before = sh.warp_sums[warp] + inclusive - value;
  total = sh.total;
  __syncthreads();  // warp_sums / total are free again
  return before;
}

// Keys [i0, i0 + kKeysPerThread) of the row; 0 for groups of 4 that start at or past n (the row
// holds whole groups of 4).
__device__ __forceinline__ void LoadKeys(const uint32_t* keys, int i0, int n,
                                         uint32_t (&key)[kKeysPerThread]) {
#pragma unroll
  for (int g = 0; g < kKeysPerThread; g += 4) {
    const uint4 four =
        i0 + g < n ? *reinterpret_cast<const uint4*>(keys + i0 + g) : make_uint4(0, 0, 0, 0);
    key[g] = four.x;
    key[g + 1] = four.y;
    key[g + 2] = four.z;
    key[g + 3] = four.w;
  }
}

// The k-th largest of the row's n keys (`cut`) and how many keys equal to it are kept (`ties`:
// the lowest positions among them; the k - ties others kept lie above the cut). 0 < k < n.
__device__ void RadixSelect(const uint32_t* keys, int n, uint32_t k, uint32_t& cut, uint32_t& ties,
                            SelectShared& sh) {
  uint32_t prefix = 0, mask = 0, target = k;  // target: the rank sought among keys on prefix
  for (int high = 32; high > 0;) {
    const int width = min(high, kDigitBits);
    const int shift = high - width;
    high = shift;
    const uint32_t digit_mask = (1u << width) - 1;
    for (int b = static_cast<int>(threadIdx.x); b < kBins; b += kSelectThreads) sh.hist[b] = 0;
    if (threadIdx.x == 0) {  // unreachable fallback: the counts always reach the target
      sh.bin = 0;
      sh.target = 1;
    }
    __syncthreads();
    for (int base = 0; base < n; base += kBatch) {
      const int i0 = base + kKeysPerThread * static_cast<int>(threadIdx.x);
      uint32_t key[kKeysPerThread];
      LoadKeys(keys, i0, n, key);
      // Plain shared atomics: on Hopper faster than aggregating equal bins per warp
      // (__match_any_sync), even when every key falls in one bin.
#pragma unroll
      for (int e = 0; e < kKeysPerThread; ++e) {
        if (i0 + e < n && (key[e] & mask) == prefix) {
          atomicAdd(&sh.hist[(key[e] >> shift) & digit_mask], 1u);
        }
      }
    }
    __syncthreads();
    // Bins from the top: thread t holds bins top and top - 1.
    const int top = kBins - 1 - 2 * static_cast<int>(threadIdx.x);
    const uint32_t upper = sh.hist[top], lower = sh.hist[top - 1];
    unsigned long long total;
    const uint32_t before = static_cast<uint32_t>(BlockExclusiveSum(upper + lower, total, sh));
    if (before < target && target <= before + upper) {
      sh.bin = static_cast<uint32_t>(top);
      sh.target = target - before;
    } else if (before + upper < target && target <= before + upper + lower) {
      sh.bin = static_cast<uint32_t>(top - 1);
      sh.target = target - before - upper;
    }
    __syncthreads();
    prefix |= sh.bin << shift;
    mask |= digit_mask << shift;
    target = sh.target;
    __syncthreads();  // bin / target / hist are rewritten by the next digit
  }
  cut = prefix;
  ties = target;
}

// Per key: 1 << 32 above the cut, 1 equal to it, 0 below it or past the row; summed over keys:
// (number above << 32) + number tied.
__device__ __forceinline__ unsigned long long KeepFlag(uint32_t key, bool valid, uint32_t cut) {
  return !valid ? 0 : key > cut ? 1ull << 32 : key == cut ? 1 : 0;
}

// One pass in position order: a key is kept if above the cut, or equal to it and among the first
// `ties` such; its slot in `out` is the number of kept keys before it. Stops once k are written.
__device__ void WriteKept(const uint32_t* keys, int n, uint32_t cut, uint32_t ties, uint32_t k,
                          int begin, int32_t* out, SelectShared& sh) {
  unsigned long long carry = 0;  // KeepFlag summed over the batches done
  for (int base = 0; base < n; base += kBatch) {
    const int i0 = base + kKeysPerThread * static_cast<int>(threadIdx.x);
    uint32_t key[kKeysPerThread];
    LoadKeys(keys, i0, n, key);
    unsigned long long local = 0;
#pragma unroll
    for (int e = 0; e < kKeysPerThread; ++e) local += KeepFlag(key[e], i0 + e < n, cut);
    unsigned long long batch_total;
    unsigned long long running = carry + BlockExclusiveSum(local, batch_total, sh);
#pragma unroll
    for (int e = 0; e < kKeysPerThread; ++e) {
      const unsigned long long flag = KeepFlag(key[e], i0 + e < n, cut);
      const uint32_t above = static_cast<uint32_t>(running >> 32);
      const uint32_t tied = static_cast<uint32_t>(running);
      if (flag > 1 || (flag == 1 && tied < ties)) out[above + min(tied, ties)] = begin + i0 + e;
      running += flag;
    }
    carry += batch_total;
    if ((carry >> 32) + min(static_cast<uint32_t>(carry), ties) >= k) break;  // block-uniform
  }
}

// Row blockIdx.x: selected_count, then the kept positions.
__global__ void __launch_bounds__(kSelectThreads)
    SelectKernel(const PooledTopKParams p, const Workspace w) {
  __shared__ SelectShared sh;
  const int r = static_cast<int>(blockIdx.x);
  const Candidates c = LoadCandidates(p, r / p.num_kv_heads);
  const int k = RowK(p, r / p.num_kv_heads);
  if (threadIdx.x == 0) p.selected_count[r] = min(k, c.count);
  if (k == 0) return;
  int32_t* out = p.selected + static_cast<int64_t>(r) * p.k;
  if (c.count <= k) {  // every candidate, already ascending
    for (int i = static_cast<int>(threadIdx.x); i < c.count; i += kSelectThreads) {
      out[i] = c.begin + i;
    }
    return;
  }
  const uint32_t* keys = w.keys + r * w.key_stride;
  uint32_t cut, ties;
  RadixSelect(keys, c.count, static_cast<uint32_t>(k), cut, ties, sh);
  WriteKept(keys, c.count, cut, ties, static_cast<uint32_t>(k), c.begin, out, sh);
}

Status Validate(const PooledTopKParams& p);

}  // namespace

// ---- launcher ---------------------------------------------------------------------------------

size_t PooledTopKWorkspaceBytes(int batch, int num_heads, int num_kv_heads, int max_count) {
  const Layout layout = MakeLayout(batch, num_heads, num_kv_heads, max_count);
  return layout.keys_bytes + layout.stats_bytes;
}

Status PooledTopK(const PooledTopKParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.batch == 0) return Status::Ok();
  const Layout layout =
      MakeLayout(params.batch, params.num_heads, params.num_kv_heads, params.max_count);
  char* base = static_cast<char*>(params.workspace);
  const Workspace w{reinterpret_cast<uint32_t*>(base),
                    reinterpret_cast<float2*>(base + layout.keys_bytes), layout.key_stride,
                    layout.chunks};
  const int rows = params.batch * params.num_kv_heads;
  if (params.max_count > 0) {
    const int group = params.num_heads / params.num_kv_heads;
    const dim3 grid(static_cast<unsigned>(layout.chunks),
                    static_cast<unsigned>(std::min(rows, kMaxGridY)));
    if (params.head_lse == nullptr && !params.pooled_input) {
      HeadStatsKernel<<<grid, kScoreThreads, 0, stream>>>(params, w);
      RUBATO_RETURN_IF_ERROR(LaunchStatus("pooled_top_k head stats"));
    }
    PooledKeysKernel<<<grid, kScoreThreads, group * sizeof(float2), stream>>>(params, w);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("pooled_top_k pooled keys"));
  }
  SelectKernel<<<rows, kSelectThreads, 0, stream>>>(params, w);
  return LaunchStatus("pooled_top_k select");
}

// ---- validation -------------------------------------------------------------------------------

namespace {

Status Validate(const PooledTopKParams& p) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("PooledTopK: " + what);
  };
  if (p.batch < 0) return invalid("batch = " + std::to_string(p.batch) + " must be >= 0");
  if (p.num_kv_heads < 1) {
    return invalid("num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be >= 1");
  }
  if (p.num_heads < 1 || p.num_heads % p.num_kv_heads != 0) {
    return invalid(
        "num_heads = " + std::to_string(p.num_heads) +
        " must be a positive multiple of num_kv_heads = " + std::to_string(p.num_kv_heads));
  }
  if (p.num_heads / p.num_kv_heads > kMaxGroup) {
    return invalid("num_heads / num_kv_heads = " + std::to_string(p.num_heads / p.num_kv_heads) +
                   " query heads per KV head exceed " + std::to_string(kMaxGroup));
  }
  if (static_cast<int64_t>(p.batch) * p.num_heads > INT_MAX) {
    return invalid(
        "batch * num_heads = " + std::to_string(static_cast<int64_t>(p.batch) * p.num_heads) +
        " exceeds INT_MAX");
  }
  if (p.pooled_input && (p.num_heads != p.num_kv_heads || p.head_lse != nullptr)) {
    return invalid("pooled_input needs num_heads == num_kv_heads and no head_lse");
  }
  if (p.k < 0) return invalid("k = " + std::to_string(p.k) + " must be >= 0");
  if (p.max_count < 0 || p.max_count > kMaxCount) {
    return invalid("max_count = " + std::to_string(p.max_count) + " must lie in [0, " +
                   std::to_string(kMaxCount) + "]");
  }
  if (p.batch == 0) return Status::Ok();  // nothing is read or written
  if (p.begin == nullptr) return invalid("begin is null");
  if (p.count == nullptr) return invalid("count is null");
  if (p.selected_count == nullptr) return invalid("selected_count is null");
  if (p.selected == nullptr && p.k > 0) return invalid("selected is null");
  if (p.max_count == 0) return Status::Ok();  // only the counts (all 0) are written
  if (p.scores == nullptr) return invalid("scores is null");
  if (p.scores_stride < p.max_count || p.scores_stride > INT32_MAX) {
    return invalid("scores_stride = " + std::to_string(p.scores_stride) + " must lie in [" +
                   "max_count = " + std::to_string(p.max_count) + ", INT32_MAX]");
  }
  const size_t needed = PooledTopKWorkspaceBytes(p.batch, p.num_heads, p.num_kv_heads, p.max_count);
  if (p.workspace == nullptr || p.workspace_bytes < needed) {
    return invalid("workspace of " + std::to_string(p.workspace_bytes) + " bytes; " +
                   std::to_string(needed) + " needed (PooledTopKWorkspaceBytes)");
  }
  if (!Aligned16(p.workspace)) return invalid("workspace is not 16-byte aligned");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
