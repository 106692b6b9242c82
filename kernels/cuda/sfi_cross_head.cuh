// SFI Selector, kernel 2 of 3 (sfi_selector.cu launches it): soft-NMS (Eqs. 20–21) and cross-head
// exclusivity (Eqs. 22–23) at each (sequence, position), over the H KV heads.
//
// One thread per (sequence, position j of J), kCrossHeadThreads per block; grid.x covers
// max_j_count positions, grid.y strides over the sequences. For each head h, the neighbourhood
// maximum m_h(j) over [j − half, j + half] ∩ J comes from the prefix / suffix maxima kernel 1 left
// in a / b (WindowMax); z_nms = z − α_soft [m − z]_+ replaces z in place, then a softmax over the
// heads of z_nms / T gives z_adj = z_nms + α_cross · max(log r_h, log ε), again in place (the log
// of the responsibility is taken in the log domain: z_nms / T − max − log Σ, the same value as
// log(max(r_h, ε)) without forming r_h). Only thread j touches z[·][j], so the in-place writes
// race with nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/sfi_selector_device.cuh"

namespace rubato::cuda::sfi {

constexpr int kCrossHeadThreads = 256;

// max of z over [lo, hi] (0 <= lo <= hi < n, hi − lo < segment) from the segmented prefix maxima
// `prefix` and suffix maxima `suffix` of kernel 1 (segments [kL, (k + 1)L) ∩ [0, n)). If the range
// spans two segments, it is the first one's suffix from lo plus the second one's prefix to hi;
// within one segment it starts at the segment's start (a full or left-clipped window) or ends at
// its end (a right-clipped window: hi = n − 1, the last segment's end).
__device__ __forceinline__ float WindowMax(const float* prefix, const float* suffix, int lo, int hi,
                                           int segment) {
  if (lo / segment != hi / segment) return fmaxf(suffix[lo], prefix[hi]);
  return lo % segment == 0 ? prefix[hi] : suffix[lo];
}

__global__ void __launch_bounds__(kCrossHeadThreads) SfiCrossHeadKernel(const KernelArgs args) {
  const DeviceConfig& c = args.config;
  const int H = args.num_kv_heads;
  const int j = static_cast<int>(blockIdx.x) * kCrossHeadThreads + static_cast<int>(threadIdx.x);
  for (int sequence = blockIdx.y; sequence < args.batch; sequence += gridDim.y) {
    const AllowedSet set = LoadAllowedSet(args, sequence);
    if (j >= set.count) continue;
    const int n = set.count;
    const int half = c.nms_half;
    const int segment = 2 * half + 1;
    // [j − half, j + half] ∩ [0, n), in 64 bits: j + half may pass INT_MAX.
    const int lo = static_cast<int>(max(static_cast<int64_t>(j) - half, int64_t{0}));
    const int hi =
        static_cast<int>(min(static_cast<int64_t>(j) + half, static_cast<int64_t>(n - 1)));
    const int first_row = sequence * H;

    // Eqs. 20–21, and the max over heads of z_nms / T.
    float scaled_max = -INFINITY;
    for (int h = 0; h < H; ++h) {
      float* z = WorkspaceRow(args.z, args, first_row + h);
      const float zj = z[j];
      const float m = half == 0
                          ? zj
                          : WindowMax(WorkspaceRow(args.a, args, first_row + h),
                                      WorkspaceRow(args.b, args, first_row + h), lo, hi, segment);
      const float nms = zj - c.alpha_soft * fmaxf(m - zj, 0.f);
      z[j] = nms;
      scaled_max = fmaxf(scaled_max, nms / c.temperature);
    }
    // Eq. 22: Σ_h exp(z_nms / T − max) >= 1 (the max term is 1).
    float total = 0.f;
    for (int h = 0; h < H; ++h) {
      total += expf(WorkspaceRow(args.z, args, first_row + h)[j] / c.temperature - scaled_max);
    }
    const float log_total = logf(total);
    // Eq. 23.
    for (int h = 0; h < H; ++h) {
      float* z = WorkspaceRow(args.z, args, first_row + h);
      const float nms = z[j];
      const float log_responsibility = nms / c.temperature - scaled_max - log_total;
      const float adjusted = nms + c.alpha_cross * fmaxf(log_responsibility, c.log_epsilon);
      z[j] = adjusted;
      if (args.scores != nullptr) {
        args.scores[static_cast<int64_t>(first_row + h) * args.max_j_count + j] = adjusted;
      }
    }
  }
}

}  // namespace rubato::cuda::sfi
