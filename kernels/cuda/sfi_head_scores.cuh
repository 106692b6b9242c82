// SFI Selector, stage A (sfi_selector.cu launches these): the evidence f of Eqs. 6–8, the prior
// statistics of Eqs. 9–12 and the sums of Eq. 18 for every (sequence, KV head), split over
// chunks of kChunk positions so that the whole GPU works on it. Cross-chunk reductions go through
// per-chunk partials in the workspace: a kernel writes its chunk's partial, the next kernel
// merges all of them in a fixed order (every block gets the same bits).
//
//   SfiRowStatsKernel      grid (chunk, row): per (query row w, query head g) the max and
//                          Σ exp(logit − max) over the chunk (Eq. 6's normalizer); the log prior
//                          (Eq. 11, and Eq. 9 when γ > 0) and its log-sum-exp per chunk.
//   SfiEvidenceKernel      grid (chunk, row), walked in the reverse block order (the logits the
//                          previous kernel read last are still in L2): W = 1 writes f = p (Eq. 8
//                          recovers the pooled softmax exactly for one query row) and the chunk's
//                          Eq. 18 sums; W > 1 writes μ (Eq. 7) and the chunk's max μ and
//                          Σ (μ / max)^{1/α}.
//   SfiNormalizeEvidenceKernel (W > 1) f = (μ / max μ)^{1/α} / Σ (Eq. 8) and the Eq. 18 sums.
//   SfiLargeWindowKernel   one block per row, only for a soft-NMS half-width above kHaloMax or a
//                          continuation reach above kDirectReach (or halos that leave no tile
//                          room): segmented prefix / suffix maxima of z (segments of 2·half + 1)
//                          and of the anchor evidence (segments of C + 1), from which
//                          SfiScoresKernel reads any window maximum in two lookups.
// Sums accumulate in f64; elementwise math is f32. -inf logits contribute 0; a KV head whose rows
// are all -inf (outside the contract) gets f = 0, so λ* = 0 and z = log ε everywhere.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/sfi_selector_device.cuh"

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

__global__ void __launch_bounds__(kThreads) SfiRowStatsKernel(const KernelArgs args) {
  __shared__ RowStatScratch scratch;
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = static_cast<int>(blockIdx.x);
  const int H = args.num_kv_heads;
  const int total_rows = args.batch * H;
  const int rows = args.window * args.group;
  const DeviceConfig& c = args.config;
  for (int row = blockIdx.y; row < total_rows; row += gridDim.y) {
    const int sequence = row / H, kv_head = row % H;
    const AllowedSet set = LoadAllowedSet(args, sequence);
    const int c0 = chunk * kChunk;
    if (c0 >= set.count) continue;  // uniform over the block
    const int c1 = min(c0 + kChunk, set.count);

    // Rows in batches of kRowBatch: every load of a batch is in flight before the first merge.
    // The loads are unconditional (rows and positions clamped into range, masked afterwards):
    // a load guarded by a branch that also uses its value makes the warp wait for each load in
    // turn (measured: 10 % of the HBM bandwidth).
    constexpr int kRowBatch = 4;
    for (int r0 = 0; r0 < rows; r0 += kRowBatch) {
      float v[kRowBatch][kChunkPerThread];
#pragma unroll
      for (int b = 0; b < kRowBatch; ++b) {
        const int r = min(r0 + b, rows - 1);
        const float* x = LogitsRow(args, sequence, kv_head, r / args.group, r % args.group,
                                   set.begin);
#pragma unroll
        for (int k = 0; k < kChunkPerThread; ++k) {
          v[b][k] = x[min(c0 + k * kThreads + tid, c1 - 1)];
        }
      }
      // In log2 units (exp2 is one MUFU op; the accurate expf is ~10 instructions): the sums are
      // the same, the maxima are converted back to natural units below.
      const float scale_log2 = args.logit_scale * kLog2ef;
#pragma unroll
      for (int b = 0; b < kRowBatch; ++b) {
#pragma unroll
        for (int k = 0; k < kChunkPerThread; ++k) {
          const int j = c0 + k * kThreads + tid;
          v[b][k] = r0 + b < rows && j < c1 ? ScaledLogit(v[b][k], scale_log2) : -INFINITY;
        }
      }
#pragma unroll
      for (int b = 0; b < kRowBatch; ++b) {
        const int r = r0 + b;
        if (r >= rows) break;  // uniform over the block
        float m = -INFINITY;
#pragma unroll
        for (int k = 0; k < kChunkPerThread; ++k) m = fmaxf(m, v[b][k]);
        float s = 0.f;
        if (m != -INFINITY) {
#pragma unroll
          for (int k = 0; k < kChunkPerThread; ++k) s += exp2f(v[b][k] - m);
        }
        const RowStat stat = BlockMergeRowStat({m * kLn2f, static_cast<double>(s)}, scratch);
        if (tid == 0) {
          args.row_stats[(static_cast<int64_t>(row) * rows + r) * args.num_chunks + chunk] = stat;
        }
      }
    }

    // The log prior: without the key-norm factor it is the same for every head of the sequence,
    // so head 0 alone computes it (and stores the position factor for the later kernels).
    if (c.gamma > 0.f || kv_head == 0) {
      const float* norms = NormsRow(args, sequence, kv_head, set.begin);
      float* position_prior = args.log_position_prior + sequence * args.row_stride;
      float v[kChunkPerThread];
      float m = -INFINITY;
#pragma unroll
      for (int k = 0; k < kChunkPerThread; ++k) {
        const int j = c0 + k * kThreads + tid;
        v[k] = -INFINITY;
        if (j < c1) {
          const float position = LogPositionPrior(j, set.count, c);
          if (kv_head == 0) position_prior[j] = position;
          v[k] = norms != nullptr ? position + LogNormPrior(norms[j], c) : position;
        }
        m = fmaxf(m, v[k]);
      }
      float s = 0.f;
      if (m != -INFINITY) {  // a thread whose positions all lie past the chunk has none
#pragma unroll
        for (int k = 0; k < kChunkPerThread; ++k) s += expf(v[k] - m);
      }
      const RowStat stat = BlockMergeRowStat({m, static_cast<double>(s)}, scratch);
      if (tid == 0) args.prior_stats[static_cast<int64_t>(row) * args.num_chunks + chunk] = stat;
    }
  }
}

struct EvidenceShared {
  float row_max[kMaxRows];    // [window * group]: max scaled logit over J of each row
  float row_scale[kMaxRows];  // [window * group]: 1 / (G Σ exp(x − max)); 0 for a row of -inf
  RowStat prior;              // log-sum-exp of the log prior over J
  RowStatScratch stat_scratch;
  double f64[kWarps];
  float f32[kWarps];
};

// Prior r(j) = exp(log prior − max) / Σ (Eq. 12) at index j of J; inv_sum = 1 / Σ.
__device__ __forceinline__ float Prior(const KernelArgs& args, const float* position_prior,
                                       const float* norms, int j, float max, float inv_sum) {
  float log_prior = position_prior[j];
  if (norms != nullptr) log_prior += LogNormPrior(norms[j], args.config);
  return expf(log_prior - max) * inv_sum;
}

// Adds Eq. 18's terms of one position: fᵀ(f − r) and ‖f − r‖² (kernels/cpu SfiLambdaStar).
__device__ __forceinline__ void AddLambdaTerms(float f, float r, double& numerator,
                                               double& denominator) {
  const double diff = static_cast<double>(f) - static_cast<double>(r);
  numerator += static_cast<double>(f) * diff;
  denominator += diff * diff;
}

template <bool kWindowOne>
__global__ void __launch_bounds__(kThreads) SfiEvidenceKernel(const KernelArgs args) {
  __shared__ EvidenceShared sh;
  const int tid = static_cast<int>(threadIdx.x);
  // The reverse of SfiRowStatsKernel's block order: its last chunks are the L2's freshest.
  const int chunk = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int H = args.num_kv_heads;
  const int total_rows = args.batch * H;
  const int group = args.group;
  const int rows = args.window * group;
  const DeviceConfig& c = args.config;
  for (int row = static_cast<int>(gridDim.y - 1 - blockIdx.y); row < total_rows;
       row += gridDim.y) {
    const int sequence = row / H, kv_head = row % H;
    const AllowedSet set = LoadAllowedSet(args, sequence);
    const int c0 = chunk * kChunk;
    if (c0 >= set.count) continue;
    const int c1 = min(c0 + kChunk, set.count);
    const int chunks = ChunksOf(set.count);

    // Eq. 6's normalizers: the chunk statistics of SfiRowStatsKernel, merged.
    for (int r = tid; r < rows; r += kThreads) {
      const RowStat total = MergeRowStats(
          args.row_stats + (static_cast<int64_t>(row) * rows + r) * args.num_chunks, chunks);
      sh.row_max[r] = total.max;
      // Eq. 6 divides by the row sum; GQA pooling averages the group's G probabilities.
      sh.row_scale[r] =
          total.max == -INFINITY ? 0.f : static_cast<float>(1.0 / (total.sum * group));
    }
    if (tid == 0) sh.prior = MergedPrior(args, sequence, kv_head, set.count);
    __syncthreads();

    float* out = args.f + static_cast<int64_t>(row) * args.row_stride;
    const float scale_log2 = args.logit_scale * kLog2ef;  // logits to log2 units (exp2 below)
    float value[kChunkPerThread];  // W = 1: f; W > 1: μ
#pragma unroll
    for (int k = 0; k < kChunkPerThread; ++k) value[k] = 0.f;
    for (int w = 0; w < args.window; ++w) {
      float pooled[kChunkPerThread];
#pragma unroll
      for (int k = 0; k < kChunkPerThread; ++k) pooled[k] = 0.f;
      // The group's rows in batches of kRowBatch, loads unconditional (see SfiRowStatsKernel).
      constexpr int kRowBatch = 4;
      for (int g0 = 0; g0 < group; g0 += kRowBatch) {
        float x[kRowBatch][kChunkPerThread];
#pragma unroll
        for (int b = 0; b < kRowBatch; ++b) {
          const float* row_logits =
              LogitsRow(args, sequence, kv_head, w, min(g0 + b, group - 1), set.begin);
#pragma unroll
          for (int k = 0; k < kChunkPerThread; ++k) {
            x[b][k] = row_logits[min(c0 + k * kThreads + tid, c1 - 1)];
          }
        }
#pragma unroll
        for (int b = 0; b < kRowBatch; ++b) {
          const int g = g0 + b;
          if (g >= group) break;  // uniform over the block
          const int r = w * group + g;
          const float scale = sh.row_scale[r];
          if (scale == 0.f) continue;  // a row of -inf: no probability (and no -inf − -inf)
          const float row_max = sh.row_max[r] * kLog2ef;
#pragma unroll
          for (int k = 0; k < kChunkPerThread; ++k) {
            pooled[k] += exp2f(ScaledLogit(x[b][k], scale_log2) - row_max) * scale;
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kChunkPerThread; ++k) {
        value[k] += kWindowOne ? pooled[k] : powf(pooled[k], c.alpha) * c.inv_window;
      }
    }

    if constexpr (kWindowOne) {
      // Eq. 8 with W = 1: μ^{1/α} = p, whose sum over J is 1, so f = p.
      const float* position_prior = args.log_position_prior + sequence * args.row_stride;
      const float* norms = NormsRow(args, sequence, kv_head, set.begin);
      const float prior_max = sh.prior.max;
      const float prior_inv = static_cast<float>(1.0 / sh.prior.sum);
      double numerator = 0.0, denominator = 0.0;
#pragma unroll
      for (int k = 0; k < kChunkPerThread; ++k) {
        const int j = c0 + k * kThreads + tid;
        if (j < c1) {
          out[j] = value[k];
          AddLambdaTerms(value[k], Prior(args, position_prior, norms, j, prior_max, prior_inv),
                         numerator, denominator);
        }
      }
      numerator = BlockReduce(numerator, SumOp{}, sh.f64);
      denominator = BlockReduce(denominator, SumOp{}, sh.f64);
      if (tid == 0) {
        args.lambda_sums[static_cast<int64_t>(row) * args.num_chunks + chunk] = {numerator,
                                                                                 denominator};
      }
    } else {
      float mu_max = 0.f;
#pragma unroll
      for (int k = 0; k < kChunkPerThread; ++k) {
        const int j = c0 + k * kThreads + tid;
        if (j < c1) {
          out[j] = value[k];
          mu_max = fmaxf(mu_max, value[k]);
        }
      }
      mu_max = BlockReduce(mu_max, MaxOp{}, sh.f32);
      double sum = 0.0;
      if (mu_max > 0.f) {
#pragma unroll
        for (int k = 0; k < kChunkPerThread; ++k) {
          const int j = c0 + k * kThreads + tid;
          if (j < c1) sum += static_cast<double>(powf(value[k] / mu_max, c.inv_alpha));
        }
      }
      sum = BlockReduce(sum, SumOp{}, sh.f64);
      if (tid == 0) args.mu_stats[static_cast<int64_t>(row) * args.num_chunks + chunk] = {mu_max, sum};
    }
    __syncthreads();  // the shared statistics are rewritten for the next row
  }
}

// W > 1: Eq. 8 with μ scaled by its maximum over J before the 1/α power (the normalization
// cancels the scale; it keeps μ^{1/α} from underflowing when α is small), as the CPU twin.
__global__ void __launch_bounds__(kThreads) SfiNormalizeEvidenceKernel(const KernelArgs args) {
  __shared__ double f64[kWarps];
  __shared__ float mu_max_shared;
  __shared__ double inv_total_shared;
  __shared__ RowStat prior_shared;
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk = static_cast<int>(blockIdx.x);
  const int H = args.num_kv_heads;
  const int total_rows = args.batch * H;
  const DeviceConfig& c = args.config;
  for (int row = blockIdx.y; row < total_rows; row += gridDim.y) {
    const int sequence = row / H, kv_head = row % H;
    const AllowedSet set = LoadAllowedSet(args, sequence);
    const int c0 = chunk * kChunk;
    if (c0 >= set.count) continue;
    const int c1 = min(c0 + kChunk, set.count);
    if (tid == 0) {
      const RowStat* stats = args.mu_stats + static_cast<int64_t>(row) * args.num_chunks;
      float mu_max = 0.f;
      for (int k = 0; k < ChunksOf(set.count); ++k) mu_max = fmaxf(mu_max, stats[k].max);
      double total = 0.0;  // Σ (μ / max μ)^{1/α} from the chunks' Σ (μ / chunk max)^{1/α}
      for (int k = 0; k < ChunksOf(set.count); ++k) {
        if (stats[k].max > 0.f) {
          total += stats[k].sum * pow(static_cast<double>(stats[k].max) / mu_max, c.inv_alpha_f64);
        }
      }
      mu_max_shared = mu_max;
      inv_total_shared = total > 0.0 ? 1.0 / total : 0.0;
      prior_shared = MergedPrior(args, sequence, kv_head, set.count);
    }
    __syncthreads();
    const float mu_max = mu_max_shared;
    const float inv_total = static_cast<float>(inv_total_shared);
    const RowStat prior = prior_shared;
    float* f = args.f + static_cast<int64_t>(row) * args.row_stride;
    const float* position_prior = args.log_position_prior + sequence * args.row_stride;
    const float* norms = NormsRow(args, sequence, kv_head, set.begin);
    double numerator = 0.0, denominator = 0.0;
#pragma unroll
    for (int k = 0; k < kChunkPerThread; ++k) {
      const int j = c0 + k * kThreads + tid;
      if (j < c1) {
        // μ <= max μ, so the ratio is in [0, 1]; max μ == 0 only for a head of all -inf rows.
        const float value = mu_max > 0.f ? powf(f[j] / mu_max, c.inv_alpha) * inv_total : 0.f;
        f[j] = value;
        AddLambdaTerms(value, Prior(args, position_prior, norms, j, prior.max,
                                    static_cast<float>(1.0 / prior.sum)),
                       numerator, denominator);
      }
    }
    numerator = BlockReduce(numerator, SumOp{}, f64);
    denominator = BlockReduce(denominator, SumOp{}, f64);
    if (tid == 0) {
      args.lambda_sums[static_cast<int64_t>(row) * args.num_chunks + chunk] = {numerator,
                                                                               denominator};
    }
  }
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

// Eq. 19 at index j of J: z = log((1 − λ*) f + λ* r + ε) (Eqs. 15, 19).
__device__ __forceinline__ float LogScore(float f, float r, float lambda, const DeviceConfig& c) {
  return logf((1.f - lambda) * f + lambda * r + c.epsilon);
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
    if (threadIdx.x == 0) {
      lambda_shared = LambdaStar(args, row, n);
      prior_shared = MergedPrior(args, sequence, kv_head, n);
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
