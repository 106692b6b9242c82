// SFI Selector, stages B and C (sfi_selector.cu launches it): SfiScoresKernel, for a tile of
// positions of one sequence and all its KV heads, computes z (Eqs. 15, 19), soft-NMS
// (Eqs. 20–21), stage C's continuation priority c_h, cross-head exclusivity (Eqs. 22–23) and the
// rank keys that top-K selects by. f32: versus the CPU twin's f64 a selection changes only at
// near-ties. Grid, phases and precision: docs/sfi.md "Stages B and C".
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "inference_rank/policies/sfi/kernels/sfi_head_scores.cuh"
#include "inference_rank/policies/sfi/kernels/sfi_selector_device.cuh"

namespace rubato::cuda::sfi {

__host__ __device__ constexpr int RoundUp4(int x) { return (x + 3) / 4 * 4; }

// Stage C reaches up to this read the f tile directly (reach + 1 reads per position and head);
// wider ones take SfiLargeWindowKernel's maxima.
constexpr int kDirectReach = 32;

// Floats of the scores kernel's dynamic shared memory: per-head λ*, prior max and 1 / Σ; f, z
// (then z_nms), and the soft-NMS segment prefix and suffix maxima, each [heads][tile + 2 halo];
// the prior r [tile + 2 halo].
__host__ __device__ constexpr int ScoresSharedFloats(int tile, int heads, int halo) {
  return RoundUp4(3 * heads) + 4 * heads * (tile + 2 * halo) + (tile + 2 * halo);
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
  float* lambda = smem;                     // [H]
  float* prior_max = lambda + H;            // [H]
  float* prior_inv_sum = prior_max + H;     // [H]
  float* fbuf = smem + RoundUp4(3 * H);     // [H][row_len] f (0 outside J)
  float* zbuf = fbuf + cells;               // [H][row_len] z (-inf outside J); z_nms in phase 3
  float* prefix = zbuf + cells;             // [H][row_len] max of z from the segment start
  float* suffix = prefix + cells;           // [H][row_len] max of z to the segment end
  float* rbuf = suffix + cells;             // [row_len] prior r (γ = 0)
  const int half = c.nms_half;
  const int reach = c.continuation;
  const bool nms_shared = half > 0 && args.nms_prefix == nullptr;  // then half <= R
  const bool cont_direct = reach > 0 && args.cont_prefix == nullptr;  // then reach <= R
  const float inv_temperature = 1.f / c.temperature;

  for (int sequence = blockIdx.y; sequence < args.batch; sequence += gridDim.y) {
    const AllowedSet set = LoadAllowedSet(args, sequence);
    const int n = set.count;
    const int t0 = static_cast<int>(blockIdx.x) * T;
    if (t0 >= n) continue;  // uniform over the block
    const int lo = t0 - R;  // position of buffer index 0
    const int first_row = sequence * H;
    const float* position_prior = args.log_position_prior + sequence * args.row_stride;

    // 1. Per-head constants, one warp per head (WarpLambdaStar, WarpMergedPrior: the evidence
    // kernel's merge, bit for bit); f of every head over the tile and halo, four heads' loads in
    // flight at a time (clamped into J, masked after).
    for (int h = tid / 32; h < H; h += kWarps) {
      const float lam = WarpLambdaStar(args, first_row + h, n);
      const RowStat prior = WarpMergedPrior(args, sequence, h, n);
      if (lane == 0) {
        lambda[h] = lam;
        prior_max[h] = prior.max;
        prior_inv_sum[h] = static_cast<float>(1.0 / prior.sum);
      }
    }
    for (int i = tid; i < row_len; i += kThreads) {
      const int j = lo + i;
      const bool inside = j >= 0 && j < n;
      const int clamped = min(max(j, 0), n - 1);
      for (int h0 = 0; h0 < H; h0 += 4) {
        float values[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int h = min(h0 + u, H - 1);
          values[u] = args.f[static_cast<int64_t>(first_row + h) * args.row_stride + clamped];
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (h0 + u < H) fbuf[(h0 + u) * row_len + i] = inside ? values[u] : 0.f;
        }
      }
    }
    __syncthreads();  // prior_max / prior_inv_sum / lambda, fbuf
    if (c.gamma == 0.f) {
      for (int i = tid; i < row_len; i += kThreads) {
        const int j = lo + i;
        rbuf[i] = j >= 0 && j < n ? expf(position_prior[j] - prior_max[0]) * prior_inv_sum[0] : 0.f;
      }
      __syncthreads();
    }

    // 2. z over the tile and halo; then, per head, the maxima of z within segments of 2 half + 1
    // buffer positions from the segment start (prefix) and to its end (suffix): any window of
    // exactly 2 half + 1 positions spans at most two neighbouring segments, so its maximum is
    // max(suffix[window start], prefix[window end]) (van Herk / Gil-Werman).
    for (int h = 0; h < H; ++h) {
      for (int i = tid; i < row_len; i += kThreads) {
        const int j = lo + i;
        float z = -INFINITY;
        if (j >= 0 && j < n) {
          const float r = c.gamma == 0.f ? rbuf[i]
                                         : Prior(args, position_prior,
                                                 NormsRow(args, sequence, h, set.begin), j,
                                                 prior_max[h], prior_inv_sum[h]);
          z = LogScore(fbuf[h * row_len + i], r, lambda[h], c);
        }
        zbuf[h * row_len + i] = z;
      }
    }
    __syncthreads();
    if (nms_shared) {
      const int segment = 2 * half + 1;
      const int segments = (row_len + segment - 1) / segment;  // per head
      for (int item = tid; item < H * segments; item += kThreads) {
        const int h = item / segments;
        const int begin = (item % segments) * segment;
        const int end = min(begin + segment, row_len);
        const float* z = zbuf + h * row_len;
        float m = -INFINITY;
        for (int i = begin; i < end; ++i) {
          m = fmaxf(m, z[i]);
          prefix[h * row_len + i] = m;
        }
        m = -INFINITY;
        for (int i = end - 1; i >= begin; --i) {
          m = fmaxf(m, z[i]);
          suffix[h * row_len + i] = m;
        }
      }
      __syncthreads();
    }

    // 3. Per position: z_nms and c_h of every head, then Eqs. 22–23 and the outputs. T is a
    // multiple of 32 and t0 of T, so a warp covers the 32 positions of one forced_bits word.
    // Each thread rewrites zbuf only at its own positions (z -> z_nms).
    for (int i = tid; i < T; i += kThreads) {
      const int q = i + R;  // buffer index of the position
      const int j = t0 + i;
      const bool valid = j < n;
      float scaled_max = -INFINITY;
      if (valid) {
        for (int h = 0; h < H; ++h) {
          const float z = zbuf[h * row_len + q];
          float m = z;
          if (nms_shared) {
            m = fmaxf(suffix[h * row_len + q - half], prefix[h * row_len + q + half]);
          } else if (half > 0) {
            const int64_t offset = static_cast<int64_t>(first_row + h) * args.row_stride;
            m = WindowMax(args.nms_prefix + offset, args.nms_suffix + offset, max(j - half, 0),
                          static_cast<int>(min(static_cast<int64_t>(j) + half, int64_t{n - 1})),
                          2 * half + 1);
          }
          const float nms = z - c.alpha_soft * fmaxf(m - z, 0.f);
          zbuf[h * row_len + q] = nms;
          scaled_max = fmaxf(scaled_max, nms * inv_temperature);
        }
      }
      float log_total = 0.f;
      if (valid) {
        float total = 0.f;  // >= 1: the max term is 1
        for (int h = 0; h < H; ++h) {
          total += __expf(zbuf[h * row_len + q] * inv_temperature - scaled_max);
        }
        log_total = __logf(total);
      }
      for (int h = 0; h < H; ++h) {
        const int row = first_row + h;
        const int64_t offset = static_cast<int64_t>(row) * args.row_stride;
        float cv = 0.f;
        if (valid) {
          const float nms = zbuf[h * row_len + q];
          const float adjusted =
              nms + c.alpha_cross * fmaxf(nms * inv_temperature - scaled_max - log_total,
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
