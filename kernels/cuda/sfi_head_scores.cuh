// SFI Selector, kernel 1 of 3 (sfi_selector.cu launches it): the continuous importance of every
// allowed position for one (sequence, KV head), Eqs. 6–19, and the soft-NMS window maxima that
// kernel 2 needs for Eqs. 20–21.
//
// One block of kThreads threads per (sequence, KV head); it walks J (|J| up to INT_MAX) in
// passes, each a strided loop followed by a block reduction, keeping [|J|] f32 arrays in the
// workspace (L2-resident for |J| of a few 100K):
//   1. per (query row w, query head q of the group): max and Σ exp(logit - max) over J (online
//      softmax; teams of warps take one row each);
//   2. Eqs. 6–7: μ(j) = (1/W) Σ_w ((1/G) Σ_q p_{w,q}(j))^α -> a; max μ;
//   3. Eq. 8 numerator f_u = (μ / max μ)^{1/α} -> a and Σ f_u; the log prior of Eqs. 9–11 -> b
//      and its max / Σ exp (online);
//   4. f = f_u / Σ f_u -> a, r = exp(log prior - max) / Σ -> b (Eq. 12); fᵀ(f − r), ‖f − r‖²;
//   5. Eqs. 18, 15, 19: λ*, s = (1 − λ*) f + λ* r, z = log(s + ε) -> z;
//   6. for soft-NMS (nms_window >= 2): segmented prefix and suffix maxima of z over segments of
//      L = 2·half + 1 positions aligned at 0 (van Herk / Gil-Werman) -> a and b. The maximum over
//      any clipped neighbourhood [j − half, j + half] ∩ J, at most L long, is then one or two
//      lookups (WindowMax in sfi_cross_head.cuh), whatever the window: O(|J|) per head.
// Sums accumulate in f64 (per thread, then across the block); elementwise math is f32. Nothing
// can become NaN: -inf logits contribute 0, a KV head whose rows are all -inf (outside the
// contract) gets f = 0 and so λ* = 0 and z = log ε everywhere.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/sfi_selector_device.cuh"

namespace rubato::cuda::sfi {

// max and Σ exp(x − max) of a set of values; max == -inf <=> the set has no finite value (sum 0).
struct LogSumExp {
  float max;
  double sum;
};

__device__ __forceinline__ LogSumExp MergeLogSumExp(LogSumExp a, LogSumExp b) {
  if (a.max < b.max) {
    const LogSumExp t = a;
    a = b;
    b = t;
  }
  if (b.max == -INFINITY) return a;  // also both empty: no -inf − -inf
  return {a.max, a.sum + b.sum * static_cast<double>(expf(b.max - a.max))};
}

__device__ __forceinline__ LogSumExp AddToLogSumExp(LogSumExp acc, float x) {
  if (x > acc.max) {  // acc.max == -inf gives exp(-inf) = 0: the empty sum is dropped
    acc.sum = acc.sum * static_cast<double>(expf(acc.max - x)) + 1.0;
    acc.max = x;
  } else if (x != -INFINITY) {
    acc.sum += static_cast<double>(expf(x - acc.max));
  }
  return acc;
}

__device__ __forceinline__ LogSumExp WarpMergeLogSumExp(LogSumExp v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const LogSumExp other{__shfl_xor_sync(kFullMask, v.max, offset),
                          __shfl_xor_sync(kFullMask, v.sum, offset)};
    v = MergeLogSumExp(v, other);
  }
  return v;
}

struct HeadScoresShared {
  float row_max[kMaxRows];    // [window * group]: max scaled logit over J of each row
  float row_scale[kMaxRows];  // [window * group]: 1 / (G Σ exp(x − max)); 0 for a row of -inf
  float lse_max[kWarps];      // warp partials of pass 1 and of the prior's online sum
  double lse_sum[kWarps];
  float f32[kWarps];  // BlockReduce scratch per type
  double f64[kWarps];
  int seg_start[kWarps];  // segmented scan: per-warp aggregates
  float seg_max[kWarps];
};

// The whole block's LogSumExp (every thread gets it). Uses lse_max / lse_sum.
__device__ LogSumExp BlockMergeLogSumExp(LogSumExp v, HeadScoresShared& sh) {
  v = WarpMergeLogSumExp(v);
  if (threadIdx.x % 32 == 0) {
    sh.lse_max[threadIdx.x / 32] = v.max;
    sh.lse_sum[threadIdx.x / 32] = v.sum;
  }
  __syncthreads();
  LogSumExp total{sh.lse_max[0], sh.lse_sum[0]};
  for (int w = 1; w < kWarps; ++w) total = MergeLogSumExp(total, {sh.lse_max[w], sh.lse_sum[w]});
  __syncthreads();
  return total;
}

// A run of a segmented max-scan: `start` says whether it holds a segment start; `max` is the
// maximum since its last segment start (or over all of it when it holds none).
struct SegmentMax {
  int start;
  float max;
};

__device__ __forceinline__ SegmentMax CombineSegments(SegmentMax earlier, SegmentMax later) {
  return {earlier.start | later.start, later.start ? later.max : fmaxf(earlier.max, later.max)};
}

// out[i] = max of in over [segment start of i, i] (forward) or [i, segment end of i] (kBackward),
// segments being [kL, (k + 1)L) ∩ [0, n). Tiles of kPer * kThreads elements in scan order, each
// thread kPer consecutive ones, a block-wide segmented scan per tile with a carry between tiles.
template <bool kBackward>
__device__ void SegmentedMaxScan(const float* in, float* out, int n, int segment,
                                 HeadScoresShared& sh) {
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
      x[e] = valid ? in[i] : -INFINITY;
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

// Block blockIdx.x = sequence * num_kv_heads + kv_head.
__global__ void __launch_bounds__(kThreads) SfiHeadScoresKernel(const KernelArgs args) {
  __shared__ HeadScoresShared sh;
  const int row = static_cast<int>(blockIdx.x);
  const int sequence = row / args.num_kv_heads;
  const int kv_head = row % args.num_kv_heads;
  const AllowedSet set = LoadAllowedSet(args, sequence);
  const int n = set.count;
  if (n == 0) return;  // the whole block: nothing to score
  const DeviceConfig& c = args.config;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32, warp = tid / 32;
  const int group = args.group;
  const int rows = args.window * group;
  const int num_heads = args.num_kv_heads * group;
  float* a = WorkspaceRow(args.a, args, row);
  float* b = WorkspaceRow(args.b, args, row);
  float* z = WorkspaceRow(args.z, args, row);
  // [n] f32 logits over J of query row w, query head g of this KV head's group.
  const auto logits_row = [&](int w, int g) {
    return args.logits +
           (static_cast<int64_t>(sequence) * args.window + w) * num_heads * args.logits_stride +
           static_cast<int64_t>(kv_head * group + g) * args.logits_stride + set.begin;
  };

  // ---- 1. softmax statistics of every (query row, query head) -------------------------------
  // Teams of kThreads / teams threads (whole warps) take rows first + team; every thread runs the
  // same number of iterations so the barriers stay uniform.
  int teams = 1;
  while (teams * 2 <= rows && teams * 2 <= kWarps) teams *= 2;
  const int team_threads = kThreads / teams;
  const int warps_per_team = team_threads / 32;
  const int team = tid / team_threads;
  const int team_tid = tid % team_threads;
  for (int first = 0; first < rows; first += teams) {
    const int r = first + team;
    LogSumExp acc{-INFINITY, 0.0};
    if (r < rows) {
      const float* x = logits_row(r / group, r % group);
      for (int j = team_tid; j < n; j += team_threads) {
        acc = AddToLogSumExp(acc, ScaledLogit(x[j], args.logit_scale));
      }
    }
    acc = WarpMergeLogSumExp(acc);
    if (lane == 0) {
      sh.lse_max[warp] = acc.max;
      sh.lse_sum[warp] = acc.sum;
    }
    __syncthreads();
    if (team_tid == 0 && r < rows) {
      LogSumExp total{sh.lse_max[team * warps_per_team], sh.lse_sum[team * warps_per_team]};
      for (int k = 1; k < warps_per_team; ++k) {
        const int w = team * warps_per_team + k;
        total = MergeLogSumExp(total, {sh.lse_max[w], sh.lse_sum[w]});
      }
      sh.row_max[r] = total.max;
      // Eq. 6 divides by the row sum; GQA pooling averages the group's G probabilities.
      sh.row_scale[r] =
          total.max == -INFINITY ? 0.f : static_cast<float>(1.0 / (total.sum * group));
    }
    __syncthreads();
  }

  // ---- 2. Eqs. 6–7: μ -> a ------------------------------------------------------------------
  float mu_max = 0.f;
  for (int j = tid; j < n; j += kThreads) {
    float mu = 0.f;
    for (int w = 0; w < args.window; ++w) {
      float pooled = 0.f;
      for (int g = 0; g < group; ++g) {
        const int r = w * group + g;
        const float scale = sh.row_scale[r];
        if (scale == 0.f) continue;  // a row of -inf: no probability (and no -inf − -inf)
        pooled += expf(ScaledLogit(logits_row(w, g)[j], args.logit_scale) - sh.row_max[r]) * scale;
      }
      mu += powf(pooled, c.alpha) * c.inv_window;
    }
    a[j] = mu;
    mu_max = fmaxf(mu_max, mu);
  }
  mu_max = BlockReduce(mu_max, MaxOp{}, sh.f32);

  // ---- 3. Eq. 8 numerator -> a; Eqs. 9–11 log prior -> b --------------------------------------
  // u(j) = j / (n − 1 + ε) and 1 − u(j) = (n − 1 − j + ε) / (n − 1 + ε): the second form keeps
  // the tail brake exact at the last positions, where 1 − u is ~ε / n (f32 would round u to 1).
  const float span = static_cast<float>(n - 1) + c.epsilon;
  double f_sum = 0.0;
  LogSumExp prior{-INFINITY, 0.0};
  const float* norms =
      c.gamma > 0.f
          ? args.key_norms +
                (static_cast<int64_t>(sequence) * args.num_kv_heads + kv_head) * args.norms_stride +
                set.begin
          : nullptr;
  for (int j = tid; j < n; j += kThreads) {
    // μ <= max μ, so the ratio is in [0, 1]; max μ == 0 only for a head of all -inf rows.
    const float f_u = mu_max > 0.f ? powf(a[j] / mu_max, c.inv_alpha) : 0.f;
    a[j] = f_u;
    f_sum += f_u;
    const float u = static_cast<float>(j) / span;
    const float one_minus_u = (static_cast<float>(n - 1 - j) + c.epsilon) / span;
    float log_prior = -c.beta * powf(u, c.p) + c.eta * logf(one_minus_u + c.epsilon);
    if (norms != nullptr) {
      // fmaxf maps NaN and negatives (outside the contract) to 0, fminf +inf to FLT_MAX.
      const float norm = fminf(fmaxf(norms[j], 0.f), 3.402823466e+38f);
      log_prior -= c.gamma * logf(norm + c.epsilon);
    }
    b[j] = log_prior;
    prior = AddToLogSumExp(prior, log_prior);
  }
  f_sum = BlockReduce(f_sum, SumOp{}, sh.f64);
  prior = BlockMergeLogSumExp(prior, sh);  // max finite: every log prior is finite

  // ---- 4. f and r (Eqs. 8, 12) -> a, b; the sums of Eq. 18 ----------------------------------
  double numerator = 0.0, denominator = 0.0;
  for (int j = tid; j < n; j += kThreads) {
    const float f = f_sum > 0.0 ? a[j] / static_cast<float>(f_sum) : 0.f;
    const float r = expf(b[j] - prior.max) / static_cast<float>(prior.sum);
    a[j] = f;
    b[j] = r;
    const double diff = static_cast<double>(f) - static_cast<double>(r);
    numerator += static_cast<double>(f) * diff;
    denominator += diff * diff;
  }
  numerator = BlockReduce(numerator, SumOp{}, sh.f64);
  denominator = BlockReduce(denominator, SumOp{}, sh.f64);

  // ---- 5. Eqs. 18, 15, 19 -> z ----------------------------------------------------------------
  // λ* = clip(fᵀ(f − r) / ‖f − r‖², 0, λ_clip), 0 when f == r (kernels/cpu SfiLambdaStar).
  const double lambda_star =
      denominator == 0.0 ? 0.0 : fmin(fmax(numerator / denominator, 0.0), c.lambda_clip);
  const float lambda = static_cast<float>(lambda_star);
  for (int j = tid; j < n; j += kThreads) {
    const float s = (1.f - lambda) * a[j] + lambda * b[j];
    z[j] = logf(s + c.epsilon);
  }
  if (c.nms_half == 0) return;  // uniform: soft-NMS is a no-op, kernel 2 skips the lookups
  __syncthreads();              // z is read across threads next

  // ---- 6. soft-NMS window maxima: prefix -> a, suffix -> b ----------------------------------
  const int segment = 2 * c.nms_half + 1;  // <= INT_MAX: nms_half <= INT_MAX / 2
  SegmentedMaxScan<false>(z, a, n, segment, sh);
  SegmentedMaxScan<true>(z, b, n, segment, sh);
}

}  // namespace rubato::cuda::sfi
