// SFI Selector, stage B and C (sfi_selector.cu launches it): for a tile of positions of one
// sequence and all its KV heads, Eqs. 15 and 19 (z from f, the prior and λ*), soft-NMS
// (Eqs. 20–21), stage C's continuation priority c_h, cross-head exclusivity (Eqs. 22–23), and
// the rank keys that top-K selects by, with the histogram of their first radix digit.
//
// Grid (tile, sequence), kThreads threads, `tile` positions per block (256 for up to 8 KV heads;
// fewer for more heads so that every head's tile fits in shared memory: cross-head exclusivity
// needs all heads at each position). First f of every head over the tile and its halos is loaded
// into shared memory (all loads in flight at once). Then per head h:
//   * z over the tile plus a halo of `half` positions on each side, and the anchor evidence
//     a(j) = f(j) if f(j) >= threshold else 0 over the tile plus C positions on the left, into
//     shared buffers (positions outside J hold -inf / 0: windows clip by themselves);
//   * window maxima by doubling: after k steps buf[i] = max over [i, i + 2^k), so a window of
//     L >= 2^K positions is the max of two entries: m(j) = max over [j − half, j + half] (soft-NMS)
//     and c(j) = max over [j − C, j] of a (stage C: the strongest anchor that reaches j, 0 if none;
//     skipped for a tile with no anchor in reach, the usual case). Windows wider than kHaloMax read
//     the per-row segmented maxima of SfiLargeWindowKernel instead.
// Then per position: z_adj (Eq. 23, the log of the responsibility taken in the log domain:
// z_nms / T − max − log Σ, the same value as log(max(r_h, ε)) without forming r_h), the key
// OrderedKey(z_adj) -> keys, and for forced positions (c > 0) the bit in forced_bits and c -> cont.
// The rank key is kForcedKey for a forced position, else the key: the forced positions come first
// (all of them, when they are at most K; sfi_top_k.cuh ranks them by (c, z_adj) when they are
// more), then Eq. 24's order.
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

// Floats of the scores kernel's dynamic shared memory for `tile` positions, `heads` KV heads and
// halos z_halo (soft-NMS, each side) and a_halo (stage C, left), both multiples of 4: per-head
// λ*, prior max, 1 / Σ and flag; z_nms [heads][tile]; c [heads][tile]; f of every head over the
// tile and both halos [heads][tile + max(z_halo, a_halo) + z_halo]; the z buffer (tile plus
// z_halo a side, + 4 for the doubling's reads past the end); the anchor buffer (tile plus a_halo,
// + 4); the prior r over the z buffer's positions.
__host__ __device__ constexpr int ScoresFLength(int tile, int z_halo, int a_halo) {
  return tile + (z_halo > a_halo ? z_halo : a_halo) + z_halo;
}
__host__ __device__ constexpr int ScoresSharedFloats(int tile, int heads, int z_halo, int a_halo) {
  return RoundUp4(4 * heads) + 2 * heads * tile + heads * ScoresFLength(tile, z_halo, a_halo) +
         (tile + 2 * z_halo + 4) + (tile + a_halo + 4) + (tile + 2 * z_halo);
}

// In place over buf[0, len) (len a multiple of 4, at most 8 * kThreads): `steps` doubling steps,
// after which buf[i] = max over [i, i + 2^steps) ∩ [0, len). Entries whose window passes len are
// partial; callers read only entries whose window fits.
__device__ void DoublingMax(float* buf, int len, int steps) {
  const int groups = len / 4;
  float4* buf4 = reinterpret_cast<float4*>(buf);
  const float4 none = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
  for (int s = 0, w = 1; s < steps; ++s, w <<= 1) {
    float4 out[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int g = static_cast<int>(threadIdx.x) + k * kThreads;
      if (g >= groups) continue;
      const float4 a = buf4[g];
      if (w >= 4) {
        const int g2 = g + w / 4;
        const float4 b = g2 < groups ? buf4[g2] : none;
        out[k] = make_float4(fmaxf(a.x, b.x), fmaxf(a.y, b.y), fmaxf(a.z, b.z), fmaxf(a.w, b.w));
      } else {
        const float4 b = g + 1 < groups ? buf4[g + 1] : none;
        out[k] = w == 1 ? make_float4(fmaxf(a.x, a.y), fmaxf(a.y, a.z), fmaxf(a.z, a.w),
                                      fmaxf(a.w, b.x))
                        : make_float4(fmaxf(a.x, a.z), fmaxf(a.y, a.w), fmaxf(a.z, b.x),
                                      fmaxf(a.w, b.y));
      }
    }
    __syncthreads();  // every read of this step is done
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int g = static_cast<int>(threadIdx.x) + k * kThreads;
      if (g < groups) buf4[g] = out[k];
    }
    __syncthreads();
  }
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
  const DeviceConfig& c = args.config;
  float* lambda = smem;                  // [H]
  float* prior_max = lambda + H;         // [H]
  float* prior_inv_sum = prior_max + H;  // [H]
  int* has_continuation = reinterpret_cast<int*>(prior_inv_sum + H);  // [H]
  const int half = c.nms_half;
  const int reach = c.continuation;
  const bool nms_shared = half > 0 && args.nms_prefix == nullptr;
  const bool cont_shared = reach > 0 && args.cont_prefix == nullptr;
  const int z_halo = nms_shared ? RoundUp4(half) : 0;   // <= kHaloMax
  const int a_halo = cont_shared ? RoundUp4(reach) : 0;  // <= kHaloMax
  const int f_len = ScoresFLength(T, z_halo, a_halo);
  float* z_nms = smem + RoundUp4(4 * H);  // [H][T]: z, then z_nms
  float* priority = z_nms + H * T;        // [H][T]: c_h (valid where has_continuation[h])
  float* fbuf = priority + H * T;         // [H][f_len]: f at positions f_lo + i
  float* zbuf = fbuf + H * f_len;         // [T + 2 z_halo + 4]
  float* abuf = zbuf + T + 2 * z_halo + 4;  // [T + a_halo + 4]
  float* rbuf = abuf + T + a_halo + 4;      // [T + 2 z_halo]
  const int z_steps = nms_shared ? FloorLog2(2 * half + 1) : 0;
  const int a_steps = cont_shared ? FloorLog2(reach + 1) : 0;

  for (int sequence = blockIdx.y; sequence < args.batch; sequence += gridDim.y) {
    const AllowedSet set = LoadAllowedSet(args, sequence);
    const int n = set.count;
    const int t0 = static_cast<int>(blockIdx.x) * T;
    if (t0 >= n) continue;  // uniform over the block
    const int first_row = sequence * H;
    const float* position_prior = args.log_position_prior + sequence * args.row_stride;
    for (int h = tid; h < H; h += kThreads) {
      lambda[h] = LambdaStar(args, first_row + h, n);
      const RowStat prior = MergedPrior(args, sequence, h, n);
      prior_max[h] = prior.max;
      prior_inv_sum[h] = static_cast<float>(1.0 / prior.sum);
    }
    // f of every head over the tile and its halos, all loads in flight at once.
    const int f_lo = t0 - max(z_halo, a_halo);  // fbuf[h][i] holds position f_lo + i
#pragma unroll 4
    for (int idx = tid; idx < H * f_len; idx += kThreads) {
      const int h = idx / f_len;
      const int j = f_lo + idx % f_len;
      fbuf[idx] = j >= 0 && j < n ? args.f[static_cast<int64_t>(first_row + h) * args.row_stride + j]
                                  : 0.f;
    }
    __syncthreads();
    // Without the key-norm factor the prior r is the same for every head: once per tile.
    const int z_lo = t0 - z_halo;  // zbuf[i] and rbuf[i] hold position z_lo + i
    const int z_len = T + 2 * z_halo;
    if (c.gamma == 0.f) {
      for (int i = tid; i < z_len; i += kThreads) {
        const int j = z_lo + i;
        rbuf[i] = j >= 0 && j < n ? expf(position_prior[j] - prior_max[0]) * prior_inv_sum[0] : 0.f;
      }
    }
    __syncthreads();

    for (int h = 0; h < H; ++h) {
      const int row = first_row + h;
      const int64_t offset = static_cast<int64_t>(row) * args.row_stride;
      const float* f = fbuf + h * f_len - f_lo;  // f[j] for j in [f_lo, f_lo + f_len)
      const float* norms = NormsRow(args, sequence, h, set.begin);
      const float lam = lambda[h];
      const int a_lo = t0 - a_halo;  // abuf[i] holds position a_lo + i
      // Fill: z over [z_lo, t0 + T + z_halo), anchor evidence over [a_lo, t0 + T).
      const int lo = min(z_lo, a_lo);
      bool anchor = false;
      for (int j = lo + tid; j < t0 + T + z_halo; j += kThreads) {
        const bool inside = j >= 0 && j < n;
        const float fj = inside ? f[j] : 0.f;
        if (j >= z_lo) {
          float z = -INFINITY;
          if (inside) {
            const float r = c.gamma == 0.f ? rbuf[j - z_lo]
                                            : Prior(args, position_prior, norms, j, prior_max[h],
                                                    prior_inv_sum[h]);
            z = LogScore(fj, r, lam, c);
          }
          zbuf[j - z_lo] = z;
          if (j >= t0 && j < t0 + T) z_nms[h * T + j - t0] = z;
        }
        if (reach > 0 && j >= a_lo && j < t0 + T) {
          const float a = inside ? AnchorEvidence(fj, c) : 0.f;
          if (cont_shared) abuf[j - a_lo] = a;
          anchor |= a > 0.f && j >= t0 - reach;
        }
      }
      const bool tile_has_anchor = __syncthreads_or(anchor) != 0;  // also the fill's barrier

      // Eqs. 20–21.
      if (half > 0) {
        if (nms_shared) DoublingMax(zbuf, z_len, z_steps);
        for (int i = tid; i < T; i += kThreads) {
          const int j = t0 + i;
          if (j >= n) break;
          float m;
          if (nms_shared) {
            const int q = i + z_halo;  // zbuf index of j
            m = fmaxf(zbuf[q - half], zbuf[q + half - (1 << z_steps) + 1]);
          } else {
            m = WindowMax(args.nms_prefix + offset, args.nms_suffix + offset, max(j - half, 0),
                          static_cast<int>(min(static_cast<int64_t>(j) + half, int64_t{n - 1})),
                          2 * half + 1);
          }
          const float z = z_nms[h * T + i];
          z_nms[h * T + i] = z - c.alpha_soft * fmaxf(m - z, 0.f);
        }
      }
      // Stage C: c(j) = max anchor evidence over [j − C, j].
      const bool continued = reach > 0 && (!cont_shared || tile_has_anchor);
      if (tid == 0) has_continuation[h] = continued;
      if (continued) {
        if (cont_shared) DoublingMax(abuf, T + a_halo, a_steps);
        for (int i = tid; i < T; i += kThreads) {
          const int j = t0 + i;
          if (j >= n) break;
          float value;
          if (cont_shared) {
            const int q = i + a_halo;  // abuf index of j
            value = fmaxf(abuf[q - reach], abuf[q - (1 << a_steps) + 1]);
          } else {
            value = WindowMax(args.cont_prefix + offset, args.cont_suffix + offset,
                              max(j - reach, 0), j, reach + 1);
          }
          priority[h * T + i] = value;
        }
      }
      __syncthreads();  // zbuf / abuf are refilled for the next head
    }

    // Eqs. 22–23, stage C's priority, the keys and the first radix digit. T is a multiple of 32,
    // so every warp runs whole and covers 32 positions of one forced_bits word.
    for (int i = tid; i < T; i += kThreads) {
      const int j = t0 + i;
      const bool valid = j < n;
      float scaled_max = -INFINITY;
      float log_total = 0.f;
      if (valid) {
        for (int h = 0; h < H; ++h) scaled_max = fmaxf(scaled_max, z_nms[h * T + i] / c.temperature);
        float total = 0.f;  // >= 1: the max term is 1
        for (int h = 0; h < H; ++h) total += expf(z_nms[h * T + i] / c.temperature - scaled_max);
        log_total = logf(total);
      }
      for (int h = 0; h < H; ++h) {
        const int row = first_row + h;
        const int64_t offset = static_cast<int64_t>(row) * args.row_stride;
        float adjusted = 0.f, cv = 0.f;
        if (valid) {
          const float nms = z_nms[h * T + i];
          adjusted = nms + c.alpha_cross * fmaxf(nms / c.temperature - scaled_max - log_total,
                                                 c.log_epsilon);
          cv = has_continuation[h] ? priority[h * T + i] : 0.f;
          const uint32_t key = OrderedKey(adjusted);
          args.keys[offset + j] = key;
          const int64_t out = static_cast<int64_t>(row) * args.max_j_count + j;
          if (args.scores != nullptr) args.scores[out] = adjusted;
          if (args.continuation_out != nullptr) args.continuation_out[out] = cv;
          if (cv > 0.f) args.cont[offset + j] = cv;
        }
        const bool forced = valid && cv > 0.f;
        const unsigned forced_mask = __ballot_sync(kFullMask, forced);
        if (lane == 0 && j < n) {  // lane 0 holds the word's first position
          args.forced_bits[static_cast<int64_t>(row) * (args.row_stride / 32) + j / 32] =
              forced_mask;
          if (forced_mask != 0) atomicAdd(&args.forced_count[row], __popc(forced_mask));
        }
        const uint32_t rank = forced ? kForcedKey : OrderedKey(adjusted);
        WarpHistogramAdd(args.hist + static_cast<int64_t>(row) * kHistWords,
                         valid ? static_cast<int>(rank >> (32 - kBits1)) : -1);
      }
    }
    __syncthreads();  // the shared arrays are rewritten for the next sequence
  }
}

}  // namespace rubato::cuda::sfi
