// Pooled top-k on the GPU: for each (sequence, KV head) of a batch, the candidate positions the
// KV head's GQA group of query heads attends most (softmax per query head over the candidates,
// mean of the probabilities over the group, the k best kept, ties to the lower position, output
// ascending). Reads the dense decode attention's raw scores; the output is what compact gather
// takes as `selected` / `selected_count` with budget = k (compact_gather.cuh). CPU twin:
// kernels/cpu/pooled_top_k.h with ScoreUnits::kLog2 (one row, f32); where no two pooled scores
// near the cut lie within rounding (~1e-6 relative), both keep the same positions.
//
// Graph-capturable: the grids and the workspace depend on the shapes and max_count only, never
// on the device-side begin / count.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct PooledTopKParams {
  // [batch][num_heads][scores_stride], f32, log2 units (softmax weights are exp2(score)): the
  // dense decode attention's `scores` output (decode_attention.cuh). Indexed by POSITION: the
  // candidates of sequence b are scores[b][h][p] for p in [begin[b], begin[b] + count[b]); a
  // non-finite score counts as -inf.
  const float* scores = nullptr;
  int64_t scores_stride = 0;       // >= max_count, <= INT32_MAX
  const int32_t* begin = nullptr;  // [batch], device: position of sequence b's first candidate
  const int32_t* count = nullptr;  // [batch], device: its candidates, in [0, max_count]
  int max_count = 0;               // host bound of count, <= 2^30; fixes grids and workspace
  int batch = 0;                   // >= 0; 0 is a no-op
  int num_heads = 0;               // query heads, a multiple of num_kv_heads
  int num_kv_heads = 0;            // >= 1
  int k = 0;                       // positions kept per (sequence, KV head), >= 0
  // Optional [batch], device: sequence b keeps min(max(row_k[b], 0), k) positions instead (k is
  // then the capacity of each `selected` row). Kascade: k grows with each sequence's length.
  const int32_t* row_k = nullptr;
  // [batch][num_kv_heads][k], device out: the min(k_b, count[b]) kept positions of (b, h),
  // ascending; entries [selected_count[b][h], k) are left as they were.
  int32_t* selected = nullptr;
  int32_t* selected_count = nullptr;  // [batch][num_kv_heads], device out: min(k, count[b])
  // Optional [batch][num_heads], device, natural log: each query head's log-sum-exp of its
  // scores over exactly its candidates (what DecodeAttentionParams::lse gives for the same
  // scores). Given, the softmax statistics are not recomputed from the scores (one read of them
  // saved); -inf or NaN: the head adds nothing.
  const float* head_lse = nullptr;
  // The scores are already pooled over the group, in linear units (Kascade's prefill tiles:
  // PrefillMode::kPool sums): kept as they are, no softmax; needs num_heads == num_kv_heads and
  // no head_lse. A NaN counts as -inf.
  bool pooled_input = false;
  void* workspace = nullptr;  // PooledTopKWorkspaceBytes(...) bytes, 16-byte aligned
  size_t workspace_bytes = 0;
};

// Device scratch for these shapes: the pooled scores of every candidate and per-head softmax
// statistics. 0 when there is nothing to score (batch, num_kv_heads or max_count <= 0).
size_t PooledTopKWorkspaceBytes(int batch, int num_heads, int num_kv_heads, int max_count);

// begin and count live on the device and are not checked here: count is clamped to
// [0, max_count], begin to >= 0, and candidates at or past scores_stride are dropped (a caller
// bug), so nothing outside the scores rows is read. Never synchronizes; batch == 0 is a no-op.
Status PooledTopK(const PooledTopKParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
