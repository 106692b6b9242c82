// What the SFI Selector's kernels share (sfi_selector.cu launches them): the kernel argument
// struct with the workspace arrays, the f32 config, the clamped allowed set of a sequence, the
// prior formulas, the merge of two softmax statistics and the order-preserving key of a float.
// Internal to sfi_selector.cu; the op's API is sfi_selector.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>

#include "inference_rank/policies/sfi/kernels/sfi_selector.cuh"

namespace rubato::cuda::sfi {

constexpr int kThreads = 256;  // every selector kernel but the top-K (sfi_top_k.cuh)
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRows = 1024;  // window * group: per-row softmax statistics live in shared memory
// Positions per chunk of the stage A kernels (sfi_head_scores.cuh): one warp each, kLaneValues
// per lane.
constexpr int kChunk = 1024;
constexpr int kLaneValues = kChunk / 32;
// Soft-NMS half-widths up to this the scores kernel handles with a halo in shared memory; wider
// ones take the per-head segmented scans of SfiLargeWindowKernel.
constexpr int kHaloMax = 256;
constexpr int kMaxKvHeads = 64;  // the scores kernel keeps every head of a tile in shared memory
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLn2f = 0.693147180559945309f;
constexpr float kLog2ef = 1.442695040888963407f;

// SfiSelectorConfig in the precisions the kernels use (f32, except λ_clip and 1/α for merges).
struct DeviceConfig {
  int budget;
  int nms_half;      // nms_window / 2: neighbours on each side
  int continuation;  // stage C reach C (0: off)
  float continuation_threshold;
  float alpha;       // Eq. 7 power
  float inv_alpha;   // Eq. 8 power 1/α (rounded from f64, as the CPU's 1.0 / alpha)
  double inv_alpha_f64;
  float inv_window;  // 1/W
  float gamma;       // Eq. 9
  float beta;        // Eq. 11
  float p;           // Eq. 11
  float eta;         // Eq. 11
  double lambda_clip;  // Eq. 18
  float epsilon;
  float log_epsilon;  // log ε (Eq. 23's floor in the log domain)
  float alpha_soft;   // Eq. 21
  float alpha_cross;  // Eq. 23
  float temperature;  // Eq. 22
};

// max and Σ exp(x − max) of a set of values; max == -inf <=> no finite value (sum 0). Also the
// μ statistics of W > 1: max μ and Σ (μ / max)^{1/α}.
struct RowStat {
  float max;
  double sum;
};

struct LambdaSums {  // Eq. 18's fᵀ(f − r) and ‖f − r‖² over a chunk
  double numerator;
  double denominator;
};

// Everything the kernels read and write; one plain struct by value (docs/design.md §10 "Shapes
// become constants"). R = batch * num_kv_heads rows, row = sequence * num_kv_heads + kv_head; N =
// row_stride; C = num_chunks = ceil(max_j_count / kChunk). Index i of a [N] row is position j_begin
// + i of the sequence.
struct KernelArgs {
  const float* logits;  // [batch][window][num_kv_heads * group][logits_stride]
  int64_t logits_stride;
  float logit_scale;
  const int32_t* j_begin;  // [batch]
  const int32_t* j_count;  // [batch]
  const float* key_norms;  // [batch][num_kv_heads][norms_stride]; null unless gamma > 0
  int64_t norms_stride;
  int batch, num_kv_heads, group, window, max_j_count;
  int64_t position_limit;  // positions the rows hold; J is clamped to end there
  DeviceConfig config;
  int32_t* selected;        // [batch][num_kv_heads][budget]
  int32_t* selected_count;  // [batch][num_kv_heads]
  float* scores;            // optional [batch][num_kv_heads][max_j_count]: z_adj
  float* continuation_out;  // optional [batch][num_kv_heads][max_j_count]: c_h
  int64_t row_stride;       // N: max_j_count rounded up to 64
  int num_chunks;           // C
  int tile;                 // positions per block of SfiScoresKernel
  int halo;                 // its halo on each side (covers half-width and reach it handles)
  // ---- workspace ----
  float* f;                 // [R][N] Eq. 8 evidence (μ first when window > 1)
  uint32_t* keys;           // [R][N] OrderedKey(z_adj)
  float* cont;              // [R][N] c_h, written at forced positions only
  uint32_t* forced_bits;    // [R][N / 32] bit i % 32 of word i / 32: position i is forced (the
                            //   words holding a position of J, no bit past |J|)
  float* log_position_prior;  // [batch][N] Eq. 11 in the log domain
  float* nms_prefix;        // [R][N] or null: segmented prefix / suffix maxima of z, segments of
  float* nms_suffix;        //   2·half + 1 (only for half > kHaloMax)
  float* cont_prefix;       // [R][N] or null: the same for stage C's anchor evidence, segments
  float* cont_suffix;       //   of C + 1 (only for C > kHaloMax)
  RowStat* row_stats;       // [R][window * group][C] per chunk softmax statistics
  RowStat* prior_stats;     // [R][C] per chunk log-sum-exp of the log prior (row sequence * H
                            //   when gamma == 0: the prior does not depend on the head then)
  RowStat* mu_stats;        // [R][C] window > 1: max μ and Σ (μ / max μ)^{1/α} per chunk
  LambdaSums* lambda_sums;  // [R][C]
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

__device__ __forceinline__ int ChunksOf(int n) { return (n + kChunk - 1) / kChunk; }

// A logit, scaled; NaN (outside the contract) counts as -inf and +inf (or an overflowing
// product) as FLT_MAX, so that nothing downstream can become NaN.
__device__ __forceinline__ float ScaledLogit(float raw, float scale) {
  const float x = raw * scale;
  return isnan(x) ? -INFINITY : fminf(x, 3.402823466e+38f);
}

// Eq. 11 in the log domain at index j of J (n = |J|): u(j) = j / (n − 1 + ε) and
// 1 − u(j) = (n − 1 − j + ε) / (n − 1 + ε); the second form keeps the tail brake exact at the
// last positions, where 1 − u is ~ε / n (f32 would round u to 1).
__device__ __forceinline__ float LogPositionPrior(int j, int n, const DeviceConfig& c) {
  const float span = static_cast<float>(n - 1) + c.epsilon;
  const float u = static_cast<float>(j) / span;
  const float one_minus_u = (static_cast<float>(n - 1 - j) + c.epsilon) / span;
  // u^p as exp2(p log2 u) and log as log2 * ln 2: a few instructions where powf / logf take ~100
  // (this runs once per position); the prior only enters scaled by λ* <= λ_clip, so their last
  // bits do not move a selection.
  const float u_power = u > 0.f ? exp2f(c.p * log2f(u)) : 0.f;  // p >= 1: 0^p = 0
  return -c.beta * u_power + c.eta * kLn2f * log2f(one_minus_u + c.epsilon);
}

// Eq. 9 in the log domain; fmaxf maps NaN and negatives (outside the contract) to 0, fminf +inf
// to FLT_MAX.
__device__ __forceinline__ float LogNormPrior(float norm, const DeviceConfig& c) {
  return -c.gamma * logf(fminf(fmaxf(norm, 0.f), 3.402823466e+38f) + c.epsilon);
}

__device__ __forceinline__ RowStat MergeRowStat(RowStat a, RowStat b) {
  if (a.max < b.max) {
    const RowStat t = a;
    a = b;
    b = t;
  }
  if (b.max == -INFINITY) return a;  // also both empty: no -inf − -inf
  return {a.max, a.sum + b.sum * static_cast<double>(expf(b.max - a.max))};
}

// a > b  <=>  OrderedKey(a) > OrderedKey(b) for non-NaN floats; -0 maps like +0 because the CPU
// compares values.
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) == 0) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

}  // namespace rubato::cuda::sfi
