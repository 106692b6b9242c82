// What the SFI Selector's three kernels share (sfi_selector.cu launches them): the kernel
// argument struct, the f32 config, the clamped allowed set of a sequence, the workspace rows and
// the block-wide primitives. Internal to sfi_selector.cu; the op's API is sfi_selector.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/sfi_selector.cuh"

namespace rubato::cuda::sfi {

constexpr int kThreads = 512;  // per (sequence, KV head) block: head scores and top-K
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRows = 1024;  // window * group: per-row softmax statistics live in shared memory
constexpr unsigned kFullMask = 0xffffffffu;

// SfiSelectorConfig in the precisions the kernels use (f32, except λ_clip: λ* is found in f64).
struct DeviceConfig {
  int budget;
  int nms_half;        // nms_window / 2: neighbours on each side
  float alpha;         // Eq. 7 power
  float inv_alpha;     // Eq. 8 power 1/α (rounded from f64, as the CPU's 1.0 / alpha)
  float inv_window;    // 1/W (rounded from f64, as the CPU's)
  float gamma;         // Eq. 9
  float beta;          // Eq. 11
  float p;             // Eq. 11
  float eta;           // Eq. 11
  double lambda_clip;  // Eq. 18
  float epsilon;
  float log_epsilon;  // log ε (Eq. 23's floor in the log domain)
  float alpha_soft;   // Eq. 21
  float alpha_cross;  // Eq. 23
  float temperature;  // Eq. 22
};

// Everything the kernels read and write; one plain struct by value (STYLE point 5).
struct KernelArgs {
  const float* logits;  // [batch][window][num_kv_heads * group][logits_stride]
  int64_t logits_stride;
  float logit_scale;
  const int32_t* j_begin;  // [batch]
  const int32_t* j_count;  // [batch]
  const float* key_norms;  // [batch][num_kv_heads][norms_stride]; null unless gamma > 0
  int64_t norms_stride;
  int batch, num_kv_heads, group, window, max_j_count;
  // Positions the rows hold: min(logits_stride, norms_stride when read, INT_MAX). J is clamped
  // to end there.
  int64_t position_limit;
  DeviceConfig config;
  int32_t* selected;        // [batch][num_kv_heads][budget]
  int32_t* selected_count;  // [batch][num_kv_heads]
  float* scores;            // optional [batch][num_kv_heads][max_j_count]
  // Workspace: three arrays [batch][num_kv_heads][row_stride] f32. z: Eq. 19 z, then in place
  // z_nms and z_adj (sfi_cross_head.cuh); a and b: scratch of the head-scores kernel, and at its
  // end the soft-NMS prefix / suffix maxima.
  float* z;
  float* a;
  float* b;
  int64_t row_stride;
};

// J of sequence `sequence`, clamped to the contract (see SfiSelect): positions
// [begin, begin + count). Every kernel clamps the same way.
struct AllowedSet {
  int begin;
  int count;
};

__device__ __forceinline__ AllowedSet LoadAllowedSet(const KernelArgs& args, int sequence) {
  const int64_t begin = max(args.j_begin[sequence], 0);
  int64_t count = min(max(args.j_count[sequence], 0), args.max_j_count);
  count = min(count, args.position_limit - begin);
  count = max(count, int64_t{0});
  return {static_cast<int>(min(begin, int64_t{INT_MAX})), static_cast<int>(count)};
}

// Workspace row of (sequence, KV head) `row` = sequence * num_kv_heads + kv_head.
__device__ __forceinline__ float* WorkspaceRow(float* array, const KernelArgs& args, int row) {
  return array + static_cast<int64_t>(row) * args.row_stride;
}

// A logit, scaled; NaN (outside the contract) counts as -inf and +inf (or an overflowing
// product) as FLT_MAX, so that nothing downstream can become NaN.
__device__ __forceinline__ float ScaledLogit(float raw, float scale) {
  const float x = raw * scale;
  return isnan(x) ? -INFINITY : fminf(x, 3.402823466e+38f);
}

// ---- block-wide primitives (kThreads threads; called in uniform control flow) ----------------

struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};

// The reduction of `value` over the block; every thread gets the same bits (each combines the
// warp partials in the same order). `scratch`: [kWarps] shared.
template <typename T, typename Op>
__device__ T BlockReduce(T value, Op op, T* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = op(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  T result = scratch[0];
  for (int w = 1; w < kWarps; ++w) result = op(result, scratch[w]);
  __syncthreads();  // the scratch is free again
  return result;
}

// The sum of `value` over the threads before this one, and in `total` over the block.
// `scratch`: [kWarps] shared.
template <typename T>
__device__ T BlockExclusiveScan(T value, T& total, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T up = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  T exclusive = __shfl_up_sync(kFullMask, inclusive, 1);
  if (lane == 0) exclusive = T{};
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  T before{};
  total = T{};
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) before = total;
    total += scratch[w];
  }
  __syncthreads();
  return before + exclusive;
}

}  // namespace rubato::cuda::sfi
