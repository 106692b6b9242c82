// SFI Selector, stage B and C (sfi_selector.cu launches it): for a tile of positions of one
// sequence and all its KV heads, Eqs. 15 and 19 (z from f, the prior and λ*), soft-NMS
// (Eqs. 20–21), stage C's continuation priority c_h, cross-head exclusivity (Eqs. 22–23), and
// the rank keys that top-K selects by.
//
// Grid (tile, sequence), kThreads threads, `tile` positions per block (512 for up to 8 KV heads
// and the default windows; fewer for more heads or wider halos, ScoresTile). Every phase works on
// all KV heads at once, so a block needs a handful of barriers whatever the head count
// (cross-head exclusivity needs every head at each position anyway):
//   1. f of every head over the tile and a halo of R positions on each side (R covers the
//      soft-NMS half-width and stage C's reach) into shared memory, all loads in flight at once
//      (unconditional, clamped into J, masked afterwards); the prior r over the same positions;
//      λ* and the prior's normalizer of every head.
//   2. z over the tile and halo (-inf outside J), then window maxima by doubling in two ping-pong
//      buffers: after k steps buf[i] = max over [i, i + 2^k), so the soft-NMS window
//      [j − half, j + half] is the max of two entries. A half-width wider than the halo allows
//      reads the per-row segmented maxima of SfiLargeWindowKernel instead.
//   3. per position: z (recomputed from f, bitwise the value of phase 2), z_nms, stage C's
//      c_h = the largest f(a) >= threshold over a in [j − C, j] (read directly from the f tile;
//      reaches wider than kDirectReach read SfiLargeWindowKernel's maxima), Eqs. 22–23 over the
//      heads (the log of the responsibility taken in the log domain: z_nms / T − max − log Σ, the
//      same value as log(max(r_h, ε)) without forming r_h), and the outputs: keys
//      (OrderedKey(z_adj)), forced_bits and cont (c_h) where c_h > 0, the optional scores and
//      continuation arrays.
//
// f32 versus the CPU twin's f64: z_adj differs by rounding (~1e-5); c_h is the f32 evidence of the
// anchor, so an anchor whose f lies within rounding of the threshold can be one on one side only,
// and two anchors whose f agree to f32 precision tie here (then z_adj decides) while the CPU
// orders them. Both change a selection only at such near-ties.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/sfi_head_scores.cuh"
#include "kernels/cuda/sfi_selector_device.cuh"

namespace rubato::cuda::sfi {

__host__ __device__ constexpr int RoundUp4(int x) { return (x + 3) / 4 * 4; }

// Floats of f (or of one doubling buffer) per block: [heads][tile + 2 halo] fits the fill's
// registers (kFillPerThread values per thread).
constexpr int kFillPerThread = 20;
constexpr int kScoresTileFloats = kFillPerThread * kThreads;
// Stage C reaches up to this read the f tile directly (reach + 1 reads per position and head);
// wider ones take SfiLargeWindowKernel's maxima.
constexpr int kDirectReach = 32;

// Floats of the scores kernel's dynamic shared memory: per-head λ*, prior max and 1 / Σ; f and
// two doubling buffers [heads][tile + 2 halo]; the prior r [tile + 2 halo].
__host__ __device__ constexpr int ScoresSharedFloats(int tile, int heads, int halo) {
  return RoundUp4(3 * heads) + 3 * heads * (tile + 2 * halo) + (tile + 2 * halo);
}

__host__ __device__ constexpr int FloorLog2(int x) {
  int k = 0;
  while ((2 << k) <= x) ++k;  // 2^(k+1) <= x
  return k;
}

__global__ void __launch_bounds__(kThreads) SfiScoresKernel(const KernelArgs args) {
  extern __shared__ __align__(16) float smem[];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int H = args.num_kv_heads;
  const int T = args.tile;
  const int R = args.halo;
  const int row_len = T + 2 * R;  // buffer index i holds position t0 − R + i
  const int cells = H * row_len;
  const DeviceConfig& c = args.config;
  float* lambda = smem;                         // [H]
  float* prior_max = lambda + H;                // [H]
  float* prior_inv_sum = prior_max + H;         // [H]
  float* fbuf = smem + RoundUp4(3 * H);         // [H][row_len]
  float* buf_a = fbuf + cells;                  // [H][row_len]
  float* buf_b = buf_a + cells;                 // [H][row_len]
  float* rbuf = buf_b + cells;                  // [row_len]
  const int half = c.nms_half;
  const int reach = c.continuation;
  const bool nms_shared = half > 0 && args.nms_prefix == nullptr;  // then half <= R
  const bool cont_direct = reach > 0 && args.cont_prefix == nullptr;  // then reach <= R
  const int nms_steps = nms_shared ? FloorLog2(2 * half + 1) : 0;

  for (int sequence = blockIdx.y; sequence < args.batch; sequence += gridDim.y) {
    const AllowedSet set = LoadAllowedSet(args, sequence);
    const int n = set.count;
    const int t0 = static_cast<int>(blockIdx.x) * T;
    if (t0 >= n) continue;  // uniform over the block
    const int lo = t0 - R;  // position of buffer index 0
    const int first_row = sequence * H;
    const float* position_prior = args.log_position_prior + sequence * args.row_stride;

    // 1. Per-head constants; f of every head over the tile and halo; the prior r (γ = 0: the
    // same for every head).
    // One warp per head, lane-parallel merges of the chunk partials (WarpMergedPrior is what the
    // evidence kernel used, bit for bit).
    for (int h = tid / 32; h < H; h += kWarps) {
      const LambdaSums* sums =
          args.lambda_sums + static_cast<int64_t>(first_row + h) * args.num_chunks;
      double numerator = 0.0, denominator = 0.0;
      for (int k = lane; k < ChunksOf(n); k += 32) {
        numerator += sums[k].numerator;
        denominator += sums[k].denominator;
      }
      numerator = WarpSum(numerator);
      denominator = WarpSum(denominator);
      const RowStat prior = WarpMergedPrior(args, sequence, h, n);
      if (lane == 0) {
        // Eq. 18: λ* = clip(fᵀ(f − r) / ‖f − r‖², 0, λ_clip), 0 when f == r.
        lambda[h] = denominator == 0.0
                        ? 0.f
                        : static_cast<float>(
                              fmin(fmax(numerator / denominator, 0.0), c.lambda_clip));
        prior_max[h] = prior.max;
        prior_inv_sum[h] = static_cast<float>(1.0 / prior.sum);
      }
    }
    {
      // Cell tid + k * kThreads is (head, index) = (h[k], i[k]), stepped without divisions.
      float values[kFillPerThread];
      int fill_h = tid / row_len, fill_i = tid % row_len;
#pragma unroll
      for (int k = 0; k < kFillPerThread; ++k) {
        const int h = min(fill_h, H - 1);
        const int j = min(max(lo + fill_i, 0), n - 1);
        values[k] = args.f[static_cast<int64_t>(first_row + h) * args.row_stride + j];
        fill_i += kThreads;
        while (fill_i >= row_len) {
          fill_i -= row_len;
          ++fill_h;
        }
      }
      fill_h = tid / row_len;
      fill_i = tid % row_len;
#pragma unroll
      for (int k = 0; k < kFillPerThread; ++k) {
        if (fill_h < H) {
          const int j = lo + fill_i;
          fbuf[fill_h * row_len + fill_i] = j >= 0 && j < n ? values[k] : 0.f;
        }
        fill_i += kThreads;
        while (fill_i >= row_len) {
          fill_i -= row_len;
          ++fill_h;
        }
      }
    }
    __syncthreads();  // prior_max / prior_inv_sum
    if (c.gamma == 0.f) {
      for (int i = tid; i < row_len; i += kThreads) {
        const int j = lo + i;
        rbuf[i] = j >= 0 && j < n ? expf(position_prior[j] - prior_max[0]) * prior_inv_sum[0] : 0.f;
      }
    }
    __syncthreads();
    // r at buffer index i of head h.
    const auto prior_at = [&](int h, int i) {
      if (c.gamma == 0.f) return rbuf[i];
      return Prior(args, position_prior, NormsRow(args, sequence, h, set.begin), lo + i,
                   prior_max[h], prior_inv_sum[h]);
    };
    const auto z_at = [&](int h, int i) {
      const int j = lo + i;
      if (j < 0 || j >= n) return -INFINITY;
      return LogScore(fbuf[h * row_len + i], prior_at(h, i), lambda[h], c);
    };

    // 2. z, then the soft-NMS window maxima by doubling (buf_a <-> buf_b).
    const float* window_max = buf_a;
    if (nms_shared) {
      // Rows of buffers walked as (h, i) loops: no division per cell.
      for (int h = 0; h < H; ++h) {
        for (int i = tid; i < row_len; i += kThreads) buf_a[h * row_len + i] = z_at(h, i);
      }
      __syncthreads();
      float* src = buf_a;
      float* dst = buf_b;
      for (int s = 0, w = 1; s < nms_steps; ++s, w <<= 1) {
        for (int h = 0; h < H; ++h) {
          const float* in = src + h * row_len;
          float* out = dst + h * row_len;
          for (int i = tid; i < row_len; i += kThreads) {
            out[i] = i + w < row_len ? fmaxf(in[i], in[i + w]) : in[i];
          }
        }
        __syncthreads();
        float* t = src;
        src = dst;
        dst = t;
      }
      window_max = src;
    }
    // The other buffer holds z_nms of the positions below (each thread its own positions).
    float* z_nms_buf = window_max == buf_a ? buf_b : buf_a;

    // 3. Per position: z_nms and c_h of every head, then Eqs. 22–23 and the outputs. T is a
    // multiple of 32 and t0 of T, so a warp covers the 32 positions of one forced_bits word.
    for (int i = tid; i < T; i += kThreads) {
      const int q = i + R;  // buffer index of the position
      const int j = t0 + i;
      const bool valid = j < n;
      float scaled_max = -INFINITY;
      if (valid) {
        for (int h = 0; h < H; ++h) {
          const float z = z_at(h, q);
          float m = z;
          if (nms_shared) {
            const float* wm = window_max + h * row_len;
            m = fmaxf(wm[q - half], wm[q + half - (1 << nms_steps) + 1]);
          } else if (half > 0) {
            const int64_t offset = static_cast<int64_t>(first_row + h) * args.row_stride;
            m = WindowMax(args.nms_prefix + offset, args.nms_suffix + offset, max(j - half, 0),
                          static_cast<int>(min(static_cast<int64_t>(j) + half, int64_t{n - 1})),
                          2 * half + 1);
          }
          const float nms = z - c.alpha_soft * fmaxf(m - z, 0.f);
          z_nms_buf[h * row_len + q] = nms;
          scaled_max = fmaxf(scaled_max, nms / c.temperature);
        }
      }
      float log_total = 0.f;
      if (valid) {
        float total = 0.f;  // >= 1: the max term is 1
        for (int h = 0; h < H; ++h) {
          total += __expf(z_nms_buf[h * row_len + q] / c.temperature - scaled_max);
        }
        log_total = __logf(total);
      }
      for (int h = 0; h < H; ++h) {
        const int row = first_row + h;
        const int64_t offset = static_cast<int64_t>(row) * args.row_stride;
        float cv = 0.f;
        if (valid) {
          const float nms = z_nms_buf[h * row_len + q];
          const float adjusted =
              nms + c.alpha_cross * fmaxf(nms / c.temperature - scaled_max - log_total,
                                          c.log_epsilon);
          if (cont_direct) {
            const float* f = fbuf + h * row_len;
            for (int d = 0; d <= reach; ++d) cv = fmaxf(cv, AnchorEvidence(f[q - d], c));
          } else if (reach > 0) {
            cv = WindowMax(args.cont_prefix + offset, args.cont_suffix + offset, max(j - reach, 0),
                           j, reach + 1);
          }
          args.keys[offset + j] = OrderedKey(adjusted);
          const int64_t out = static_cast<int64_t>(row) * args.max_j_count + j;
          if (args.scores != nullptr) args.scores[out] = adjusted;
          if (args.continuation_out != nullptr) args.continuation_out[out] = cv;
          if (cv > 0.f) args.cont[offset + j] = cv;
        }
        const unsigned forced_mask = __ballot_sync(kFullMask, valid && cv > 0.f);
        if (lane == 0 && valid) {  // lane 0 holds the word's first position
          args.forced_bits[static_cast<int64_t>(row) * (args.row_stride / 32) + j / 32] =
              forced_mask;
        }
      }
    }
    __syncthreads();  // the shared arrays are rewritten for the next sequence
  }
}

}  // namespace rubato::cuda::sfi
