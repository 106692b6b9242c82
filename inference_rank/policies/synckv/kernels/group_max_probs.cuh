// SyncKV's selection evidence on the GPU: for each row (a request's query token at an
// anticipation step or at the prompt's end) and one cluster, its R-head's attention
// probabilities over the candidate positions [0, L), softmax per query head of the R-head's GQA
// group, the MAX over the group (App. B.1 pools a group by max), and the positions of an
// excluded list (the static set) set to -inf. The output feeds the pooled top-k
// (kernels/cuda/pooled_top_k.cuh, pooled_input) as one (sequence, KV head) row per cluster.
// CPU twin: group_max_probs_cpu.h; both compute exp2 of the same log2 scores in f32, so they
// agree to f32 rounding (a few ulp), not bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct GroupMaxProbsParams {
  // [rows][group][scores_stride], f32, log2 units: DecodeAttentionParams::scores of a launch
  // over one KV head (num_heads = group). A non-finite score counts as -inf.
  const float* scores = nullptr;
  int64_t scores_stride = 0;         // >= max_length
  const int32_t* lengths = nullptr;  // [rows], device: row r's candidates are [0, L_r)
  int max_length = 0;                // host bound of the lengths, >= 1
  int rows = 0;                      // >= 0; 0 is a no-op
  int group = 0;                     // query heads per KV head, in [1, 32]
  // Optional: row r excludes the excluded_count[r] (clamped to [0, excluded_capacity])
  // ascending positions at excluded + index(r) * excluded_row_stride, with index(r) =
  // excluded_index[r] when given (a slot of a per-request pool), else r.
  const int32_t* excluded = nullptr;
  const int32_t* excluded_index = nullptr;
  const int32_t* excluded_count = nullptr;
  int64_t excluded_row_stride = 0;
  int excluded_capacity = 0;
  // [rows] at out + r * out_row_stride, f32 linear probabilities: position p < L_r gets
  // max over the group of exp2(s - max_h) / sum_h (0 when a head has no finite score), -inf when
  // excluded; [L_r, ...) left as it was.
  float* out = nullptr;
  int64_t out_row_stride = 0;
};

Status GroupMaxProbs(const GroupMaxProbsParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
