// SFI Selector, stage A (sfi_selector.cu launches these): the evidence f of Eqs. 6–8, the prior
// statistics of Eqs. 9–12 and the sums of Eq. 18 for every (sequence, KV head), one warp per
// (row, chunk of kChunk positions) with warp-only reductions; cross-chunk reductions merge
// per-chunk partials of the workspace in a fixed order (the same bits in every warp). Also
// SfiLargeWindowKernel, the segmented maxima of wide soft-NMS windows and continuation reaches.
// The kernels one by one: docs/sfi.md "Stage A".
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "inference_rank/policies/sfi/kernels/sfi_selector_device.cuh"

namespace rubato::cuda::sfi {

// [n] logits over J of query row w, query head g of KV head `kv_head` of `sequence`.
__device__ __forceinline__ const float* LogitsRow(const KernelArgs& args, int sequence,
                                                  int kv_head, int w, int g, int begin) {
  const int64_t num_heads = static_cast<int64_t>(args.num_kv_heads) * args.group;
  return args.logits +
         ((static_cast<int64_t>(sequence) * args.window + w) * num_heads +
          static_cast<int64_t>(kv_head) * args.group + g) *
             args.logits_stride +
         begin;
}

// [n] key norms over J of (sequence, kv_head); null when γ == 0.
__device__ __forceinline__ const float* NormsRow(const KernelArgs& args, int sequence,
                                                 int kv_head, int begin) {
  if (args.key_norms == nullptr) return nullptr;
  return args.key_norms +
         (static_cast<int64_t>(sequence) * args.num_kv_heads + kv_head) * args.norms_stride +
         begin;
}

// ---- warp-wide primitives -------------------------------------------------------------------

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}
// MergeRowStat over the warp's 32 values (lane l's value merged in a fixed tree): every warp that
// merges the same values gets the same bits (lane 0's result is the one used).
__device__ __forceinline__ RowStat WarpMergeRowStat(RowStat v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = MergeRowStat(v, {__shfl_xor_sync(kFullMask, v.max, offset),
                         __shfl_xor_sync(kFullMask, v.sum, offset)});
  }
  return {__shfl_sync(kFullMask, v.max, 0), __shfl_sync(kFullMask, v.sum, 0)};
}
// MergeRowStat over stats[0, count): lane l merges entries l, l + 32, ..., then the warp's tree.
__device__ __forceinline__ RowStat WarpMergeRowStats(const RowStat* stats, int count) {
  RowStat total{-INFINITY, 0.0};
  for (int c = static_cast<int>(threadIdx.x % 32); c < count; c += 32) {
    total = MergeRowStat(total, stats[c]);
  }
  return WarpMergeRowStat(total);
}

// The warp's work item among `rows` rows of `chunks` chunks: global warp index g = blockIdx.x *
// kWarps + warp is (row, chunk) = (g / chunks, g % chunks). False for the warps past the last.
struct WarpItem {
  int row;
  int chunk;
};
__device__ __forceinline__ bool NextWarpItem(int64_t rows, int chunks, WarpItem& item) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (g >= rows * chunks) return false;
  item = {static_cast<int>(g / chunks), static_cast<int>(g % chunks)};
  return true;
}

// A stage A warp's chunk: among `sub_rows` items per (sequence, KV head) row (1, or the W x G
// query rows of the statistics), the row, the sub-row, J, and the chunk's positions [c0, c1).
struct WarpChunk {
  int row, sub_row, sequence, kv_head;
  AllowedSet set;
  int chunk, c0, c1;
};
// False for a warp past the last item or whose chunk starts past |J| (uniform over the warp).
__device__ __forceinline__ bool LoadWarpChunk(const KernelArgs& args, int sub_rows, WarpChunk& w) {
  WarpItem item;
  const int H = args.num_kv_heads;
  if (!NextWarpItem(static_cast<int64_t>(args.batch) * H * sub_rows, args.num_chunks, item)) {
    return false;
  }
  w.row = item.row / sub_rows;
  w.sub_row = item.row % sub_rows;
  w.sequence = w.row / H;
  w.kv_head = w.row % H;
  w.set = LoadAllowedSet(args, w.sequence);
  w.chunk = item.chunk;
  w.c0 = item.chunk * kChunk;
  if (w.c0 >= w.set.count) return false;
  w.c1 = min(w.c0 + kChunk, w.set.count);
  return true;
}

// Grid: one warp per (query row, chunk), query rows q = row * (window * group) + (w * group + g).
// Every lane holds kLaneValues positions of the chunk (c0 + k * 32 + lane), all loads in flight
// at once (unconditional: clamped into the chunk, masked afterwards). Statistics in log2 units
// (exp2: one MUFU op), the maximum written back in natural units.
__global__ void __launch_bounds__(kThreads) SfiRowStatsKernel(const KernelArgs args) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int rows = args.window * args.group;
  const DeviceConfig& c = args.config;
  WarpChunk w;
  if (!LoadWarpChunk(args, rows, w)) return;
  const int row = w.row, r = w.sub_row;  // (sequence, KV head) row, query row
  const int sequence = w.sequence, kv_head = w.kv_head;
  const AllowedSet set = w.set;
  const int c0 = w.c0, c1 = w.c1;

  const float* x = LogitsRow(args, sequence, kv_head, r / args.group, r % args.group, set.begin);
  const float scale_log2 = args.logit_scale * kLog2ef;
  float v[kLaneValues];
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) v[k] = x[min(c0 + k * 32 + lane, c1 - 1)];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) {
    v[k] = c0 + k * 32 + lane < c1 ? ScaledLogit(v[k], scale_log2) : -INFINITY;
    m = fmaxf(m, v[k]);
  }
  m = WarpMax(m);
  float s = 0.f;
  if (m != -INFINITY) {  // uniform over the warp
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) s += exp2f(v[k] - m);
  }
  s = WarpSum(s);
  if (lane == 0) {
    args.row_stats[(static_cast<int64_t>(row) * rows + r) * args.num_chunks + w.chunk] = {
        m * kLn2f, static_cast<double>(s)};
  }

  // The log prior: without the key-norm factor it is the same for every head of the sequence, so
  // the warps of head 0 alone compute it (and store the position factor for the later kernels).
  if (r == 0 && (c.gamma > 0.f || kv_head == 0)) {
    const float* norms = NormsRow(args, sequence, kv_head, set.begin);
    float* position_prior = args.log_position_prior + sequence * args.row_stride;
    float prior[kLaneValues];
    float pm = -INFINITY;
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) {
      const int j = c0 + k * 32 + lane;
      prior[k] = -INFINITY;
      if (j < c1) {
        const float position = LogPositionPrior(j, set.count, c);
        if (kv_head == 0) position_prior[j] = position;
        prior[k] = norms != nullptr ? position + LogNormPrior(norms[j], c) : position;
      }
      pm = fmaxf(pm, prior[k]);
    }
    pm = WarpMax(pm);  // finite: the chunk holds a position
    float ps = 0.f;
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) ps += expf(prior[k] - pm);
    ps = WarpSum(ps);
    if (lane == 0) {
      args.prior_stats[static_cast<int64_t>(row) * args.num_chunks + w.chunk] = {
          pm, static_cast<double>(ps)};
    }
  }
}

// Prior r(j) = exp(log prior − max) / Σ (Eq. 12) at index j of J; inv_sum = 1 / Σ. The MUFU
// exponential: r enters only scaled by λ* <= λ_clip (and Eq. 18's sums), so its last bits move
// nothing, and this runs once per position and head.
__device__ __forceinline__ float Prior(const KernelArgs& args, const float* position_prior,
                                       const float* norms, int j, float max, float inv_sum) {
  float log_prior = position_prior[j];
  if (norms != nullptr) log_prior += LogNormPrior(norms[j], args.config);
  return __expf(log_prior - max) * inv_sum;
}

// Adds Eq. 18's terms of one position: fᵀ(f − r) and ‖f − r‖² (kernels/cpu SfiLambdaStar).
__device__ __forceinline__ void AddLambdaTerms(float f, float r, double& numerator,
                                               double& denominator) {
  const double diff = static_cast<double>(f) - static_cast<double>(r);
  numerator += static_cast<double>(f) * diff;
  denominator += diff * diff;
}

// The prior's log-sum-exp over J of (sequence, kv_head), merged by the warp (see
// WarpMergeRowStats; every warp that needs it gets the same bits).
__device__ __forceinline__ RowStat WarpMergedPrior(const KernelArgs& args, int sequence,
                                                   int kv_head, int n) {
  const int row = sequence * args.num_kv_heads + (args.config.gamma > 0.f ? kv_head : 0);
  return WarpMergeRowStats(args.prior_stats + static_cast<int64_t>(row) * args.num_chunks,
                           ChunksOf(n));
}

// Eq. 18: λ* = clip(fᵀ(f − r) / ‖f − r‖², 0, λ_clip), 0 when f == r (kernels/cpu SfiLambdaStar),
// from the chunk sums of `row` merged by the warp (every warp gets the same bits).
__device__ __forceinline__ float WarpLambdaStar(const KernelArgs& args, int row, int n) {
  const LambdaSums* sums = args.lambda_sums + static_cast<int64_t>(row) * args.num_chunks;
  double numerator = 0.0, denominator = 0.0;
  for (int k = static_cast<int>(threadIdx.x % 32); k < ChunksOf(n); k += 32) {
    numerator += sums[k].numerator;
    denominator += sums[k].denominator;
  }
  numerator = __shfl_sync(kFullMask, WarpSum(numerator), 0);
  denominator = __shfl_sync(kFullMask, WarpSum(denominator), 0);
  if (denominator == 0.0) return 0.f;
  return static_cast<float>(fmin(fmax(numerator / denominator, 0.0), args.config.lambda_clip));
}

// Eq. 18's sums of the chunk (f in values[], the chunk's positions c0 + k * 32 + lane < c1),
// reduced over the warp; lane 0 writes them.
__device__ __forceinline__ void WriteLambdaSums(const KernelArgs& args, int row, int sequence,
                                                int kv_head, const AllowedSet& set, int chunk,
                                                int c0, int c1, const float* values) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const RowStat prior = WarpMergedPrior(args, sequence, kv_head, set.count);
  const float prior_inv = static_cast<float>(1.0 / prior.sum);
  const float* position_prior = args.log_position_prior + sequence * args.row_stride;
  const float* norms = NormsRow(args, sequence, kv_head, set.begin);
  double numerator = 0.0, denominator = 0.0;
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) {
    const int j = c0 + k * 32 + lane;
    if (j < c1) {
      AddLambdaTerms(values[k], Prior(args, position_prior, norms, j, prior.max, prior_inv),
                     numerator, denominator);
    }
  }
  numerator = WarpSum(numerator);
  denominator = WarpSum(denominator);
  if (lane == 0) {
    args.lambda_sums[static_cast<int64_t>(row) * args.num_chunks + chunk] = {numerator,
                                                                             denominator};
  }
}

// Grid: one warp per ((sequence, KV head) row, chunk). W = 1 writes f = p (Eq. 8 recovers the
// pooled softmax exactly for one query row) and the chunk's Eq. 18 sums; W > 1 writes μ (Eq. 7)
// and the chunk's max μ and Σ (μ / max)^{1/α}.
template <bool kWindowOne>
__global__ void __launch_bounds__(kThreads) SfiEvidenceKernel(const KernelArgs args) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int group = args.group;
  const int rows = args.window * group;
  const DeviceConfig& c = args.config;
  WarpChunk wc;
  if (!LoadWarpChunk(args, 1, wc)) return;
  const int row = wc.row, sequence = wc.sequence, kv_head = wc.kv_head;
  const AllowedSet set = wc.set;
  const int c0 = wc.c0, c1 = wc.c1;
  const int chunks = ChunksOf(set.count);
  const float scale_log2 = args.logit_scale * kLog2ef;

  float value[kLaneValues];  // W = 1: f; W > 1: μ
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) value[k] = 0.f;
  for (int w = 0; w < args.window; ++w) {
    float pooled[kLaneValues];
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) pooled[k] = 0.f;
    for (int g = 0; g < group; ++g) {
      const int r = w * group + g;
      // Eq. 6's normalizer: the chunk statistics of SfiRowStatsKernel, merged.
      const RowStat total = WarpMergeRowStats(
          args.row_stats + (static_cast<int64_t>(row) * rows + r) * args.num_chunks, chunks);
      if (total.max == -INFINITY) continue;  // a row of -inf: no probability (uniform)
      // Eq. 6 divides by the row sum; GQA pooling averages the group's G probabilities.
      const float scale = static_cast<float>(1.0 / (total.sum * group));
      const float row_max = total.max * kLog2ef;
      const float* x = LogitsRow(args, sequence, kv_head, w, g, set.begin);
      float raw[kLaneValues];
#pragma unroll
      for (int k = 0; k < kLaneValues; ++k) raw[k] = x[min(c0 + k * 32 + lane, c1 - 1)];
#pragma unroll
      for (int k = 0; k < kLaneValues; ++k) {
        pooled[k] += exp2f(ScaledLogit(raw[k], scale_log2) - row_max) * scale;
      }
    }
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) {
      value[k] += kWindowOne ? pooled[k] : powf(pooled[k], c.alpha) * c.inv_window;
    }
  }

  float* out = args.f + static_cast<int64_t>(row) * args.row_stride;
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) {
    const int j = c0 + k * 32 + lane;
    if (j < c1) out[j] = value[k];
  }
  if constexpr (kWindowOne) {
    // Eq. 8 with W = 1: μ^{1/α} = p, whose sum over J is 1, so f = p.
    WriteLambdaSums(args, row, sequence, kv_head, set, wc.chunk, c0, c1, value);
  } else {
    float mu_max = 0.f;
#pragma unroll
    for (int k = 0; k < kLaneValues; ++k) {
      if (c0 + k * 32 + lane < c1) mu_max = fmaxf(mu_max, value[k]);
    }
    mu_max = WarpMax(mu_max);
    double sum = 0.0;
    if (mu_max > 0.f) {  // uniform over the warp
#pragma unroll
      for (int k = 0; k < kLaneValues; ++k) {
        if (c0 + k * 32 + lane < c1) {
          sum += static_cast<double>(powf(value[k] / mu_max, c.inv_alpha));
        }
      }
    }
    sum = WarpSum(sum);
    if (lane == 0) {
      args.mu_stats[static_cast<int64_t>(row) * args.num_chunks + wc.chunk] = {mu_max, sum};
    }
  }
}

// W > 1, grid as SfiEvidenceKernel: Eq. 8 with μ scaled by its maximum over J before the 1/α
// power (the normalization cancels the scale; it keeps μ^{1/α} from underflowing when α is
// small), as the CPU twin; then the chunk's Eq. 18 sums.
__global__ void __launch_bounds__(kThreads) SfiNormalizeEvidenceKernel(const KernelArgs args) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const DeviceConfig& c = args.config;
  WarpChunk wc;
  if (!LoadWarpChunk(args, 1, wc)) return;
  const int row = wc.row, sequence = wc.sequence, kv_head = wc.kv_head;
  const AllowedSet set = wc.set;
  const int c0 = wc.c0, c1 = wc.c1;
  const int chunks = ChunksOf(set.count);
  const RowStat* stats = args.mu_stats + static_cast<int64_t>(row) * args.num_chunks;
  // max μ over J, then Σ (μ / max μ)^{1/α} from the chunks' Σ (μ / chunk max)^{1/α}.
  float mu_max = 0.f;
  for (int k = lane; k < chunks; k += 32) mu_max = fmaxf(mu_max, stats[k].max);
  mu_max = WarpMax(mu_max);
  double total = 0.0;
  for (int k = lane; k < chunks; k += 32) {
    if (stats[k].max > 0.f) {
      total += stats[k].sum * pow(static_cast<double>(stats[k].max) / mu_max, c.inv_alpha_f64);
    }
  }
  total = __shfl_sync(kFullMask, WarpSum(total), 0);
  const float inv_total = total > 0.0 ? static_cast<float>(1.0 / total) : 0.f;
  float* f = args.f + static_cast<int64_t>(row) * args.row_stride;
  float value[kLaneValues];
#pragma unroll
  for (int k = 0; k < kLaneValues; ++k) {
    const int j = c0 + k * 32 + lane;
    // μ <= max μ, so the ratio is in [0, 1]; max μ == 0 only for a head of all -inf rows.
    value[k] = j < c1 && mu_max > 0.f ? powf(f[j] / mu_max, c.inv_alpha) * inv_total : 0.f;
    if (j < c1) f[j] = value[k];
  }
  WriteLambdaSums(args, row, sequence, kv_head, set, wc.chunk, c0, c1, value);
}

// ---- wide windows: per-row segmented scans ----------------------------------------------------

// A run of a segmented max-scan: `start` says whether it holds a segment start; `max` is the
// maximum since its last segment start (or over all of it when it holds none).
struct SegmentMax {
  int start;
  float max;
};

__device__ __forceinline__ SegmentMax CombineSegments(SegmentMax earlier, SegmentMax later) {
  return {earlier.start | later.start, later.start ? later.max : fmaxf(earlier.max, later.max)};
}

struct ScanShared {
  int seg_start[kWarps];
  float seg_max[kWarps];
};

// out[i] = max of value(i) over [segment start of i, i] (forward) or [i, segment end of i]
// (kBackward), segments being [kL, (k + 1)L) ∩ [0, n). Tiles of kPer * kThreads elements in scan
// order, each thread kPer consecutive ones, a block-wide segmented scan per tile with a carry.
template <bool kBackward, typename Value>
__device__ void SegmentedMaxScan(Value value, float* out, int n, int segment, ScanShared& sh) {
  constexpr int kPer = 4;
  constexpr int kTile = kPer * kThreads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float carry = -INFINITY;  // the running maximum of the open segment at the tile start
  for (int base = 0; base < n; base += kTile) {
    const int k0 = base + kPer * static_cast<int>(threadIdx.x);  // scan-order index
    float x[kPer];
    int start[kPer];
    SegmentMax local{0, -INFINITY};
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int k = k0 + e;
      const bool valid = k < n;
      const int i = kBackward ? n - 1 - k : k;
      x[e] = valid ? value(i) : -INFINITY;
      start[e] =
          valid && (kBackward ? (i % segment == segment - 1 || i == n - 1) : i % segment == 0);
      local = CombineSegments(local, {start[e], x[e]});
    }
    SegmentMax inclusive = local;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const SegmentMax up{__shfl_up_sync(kFullMask, inclusive.start, offset),
                          __shfl_up_sync(kFullMask, inclusive.max, offset)};
      if (lane >= offset) inclusive = CombineSegments(up, inclusive);
    }
    SegmentMax exclusive{__shfl_up_sync(kFullMask, inclusive.start, 1),
                         __shfl_up_sync(kFullMask, inclusive.max, 1)};
    if (lane == 0) exclusive = {0, -INFINITY};
    if (lane == 31) {
      sh.seg_start[warp] = inclusive.start;
      sh.seg_max[warp] = inclusive.max;
    }
    __syncthreads();
    SegmentMax before{0, carry};  // carry and the warps before this one
    SegmentMax tile{0, carry};    // carry and every warp: the next tile's carry
    for (int w = 0; w < kWarps; ++w) {
      if (w == warp) before = tile;
      tile = CombineSegments(tile, {sh.seg_start[w], sh.seg_max[w]});
    }
    __syncthreads();  // seg_* are free again
    float running = CombineSegments(before, exclusive).max;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int k = k0 + e;
      if (k >= n) break;
      running = start[e] ? x[e] : fmaxf(running, x[e]);
      out[kBackward ? n - 1 - k : k] = running;
    }
    carry = tile.max;
  }
}

// max over [lo, hi] (0 <= lo <= hi < n, hi − lo < segment) from the segmented prefix maxima
// `prefix` and suffix maxima `suffix` (segments [kL, (k + 1)L) ∩ [0, n)). If the range spans two
// segments, it is the first one's suffix from lo plus the second one's prefix to hi; within one
// segment it starts at the segment's start (a full or left-clipped window) or ends at its end (a
// right-clipped window: hi = n − 1, the last segment's end).
__device__ __forceinline__ float WindowMax(const float* prefix, const float* suffix, int lo, int hi,
                                           int segment) {
  if (lo / segment != hi / segment) return fmaxf(suffix[lo], prefix[hi]);
  return lo % segment == 0 ? prefix[hi] : suffix[lo];
}

// Eq. 19 at index j of J: z = log((1 − λ*) f + λ* r + ε) (Eqs. 15, 19), with the MUFU logarithm
// (~1e-6 absolute error on z, far inside the 1e-4 the CPU comparison allows; the accurate logf
// is ~20 instructions and the scores kernel evaluates this twice per position and head).
__device__ __forceinline__ float LogScore(float f, float r, float lambda, const DeviceConfig& c) {
  return __logf((1.f - lambda) * f + lambda * r + c.epsilon);
}

// Stage C's anchor evidence: f where f >= the threshold, else 0.
__device__ __forceinline__ float AnchorEvidence(float f, const DeviceConfig& c) {
  return f >= c.continuation_threshold ? f : 0.f;
}

// One block per row; only launched for half-widths or reaches above kHaloMax.
__global__ void __launch_bounds__(kThreads) SfiLargeWindowKernel(const KernelArgs args) {
  __shared__ ScanShared sh;
  __shared__ float lambda_shared;
  __shared__ RowStat prior_shared;
  const int H = args.num_kv_heads;
  const int total_rows = args.batch * H;
  const DeviceConfig& c = args.config;
  for (int row = blockIdx.y; row < total_rows; row += gridDim.y) {
    const int sequence = row / H, kv_head = row % H;
    const AllowedSet set = LoadAllowedSet(args, sequence);
    const int n = set.count;
    if (n == 0) continue;
    if (threadIdx.x < 32) {  // one warp merges the chunk partials
      const float lambda = WarpLambdaStar(args, row, n);
      const RowStat prior = WarpMergedPrior(args, sequence, kv_head, n);
      if (threadIdx.x == 0) {
        lambda_shared = lambda;
        prior_shared = prior;
      }
    }
    __syncthreads();
    const float lambda = lambda_shared;
    const RowStat prior = prior_shared;
    const float prior_inv = static_cast<float>(1.0 / prior.sum);
    const int64_t offset = static_cast<int64_t>(row) * args.row_stride;
    const float* f = args.f + offset;
    if (args.nms_prefix != nullptr) {
      const float* position_prior = args.log_position_prior + sequence * args.row_stride;
      const float* norms = NormsRow(args, sequence, kv_head, set.begin);
      const auto z = [&](int j) {
        return LogScore(f[j], Prior(args, position_prior, norms, j, prior.max, prior_inv), lambda,
                        c);
      };
      const int segment = 2 * c.nms_half + 1;  // <= INT_MAX: nms_half <= INT_MAX / 2
      SegmentedMaxScan<false>(z, args.nms_prefix + offset, n, segment, sh);
      SegmentedMaxScan<true>(z, args.nms_suffix + offset, n, segment, sh);
    }
    if (args.cont_prefix != nullptr) {
      const auto anchor = [&](int j) { return AnchorEvidence(f[j], c); };
      const int segment = c.continuation + 1;  // continuation < INT_MAX (validated)
      SegmentedMaxScan<false>(anchor, args.cont_prefix + offset, n, segment, sh);
      SegmentedMaxScan<true>(anchor, args.cont_suffix + offset, n, segment, sh);
    }
    __syncthreads();  // lambda_shared / prior_shared are rewritten for the next row
  }
}

}  // namespace rubato::cuda::sfi
