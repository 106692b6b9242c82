// The split-K merge of two partial attention results over disjoint key sets (one query token's
// heads): given each side's normalized output o and natural-log log-sum-exp lse,
//   o   = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b),   lse = log(e^lse_a + e^lse_b),
// computed against the larger lse so nothing overflows. An lse of -inf marks an empty side,
// whose o is not read into the result (it may hold anything, NaN included); both sides empty
// give o = 0 and lse = -inf. Attention on the cache rank merges the cache rank's partial over its
// positions with the inference rank's local segment this way. CUDA twin:
// kernels/cuda/attention_merge.cuh (bf16 outputs). Narrative: docs/disaggregated.md.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace rubato {

struct AttentionMergeArgs {
  // Head h of row r of side a: o_a + r * o_a_row_stride + h * head_dim, [head_dim] f32; its lse
  // at lse_a[r * num_heads + h] (f32, natural log, finite or -inf). Side b likewise.
  const float* o_a = nullptr;
  int64_t o_a_row_stride = 0;    // >= num_heads * head_dim
  const float* lse_a = nullptr;  // [rows][num_heads]
  const float* o_b = nullptr;
  int64_t o_b_row_stride = 0;    // >= num_heads * head_dim
  const float* lse_b = nullptr;  // [rows][num_heads]
  int rows = 0;                  // query tokens (decode: sequences), >= 0; 0 is a no-op
  int num_heads = 0;             // >= 1
  int head_dim = 0;              // >= 1
  // Head h of row r of the result at out + r * out_row_stride + h * head_dim, f32. May be o_a or
  // o_b itself (same row stride): each element is read before it is written.
  float* out = nullptr;
  int64_t out_row_stride = 0;  // >= num_heads * head_dim
  // Optional [rows][num_heads], natural log; must not overlap lse_a or lse_b (the CUDA twin
  // reads a head's lse from several threads).
  float* lse_out = nullptr;
};

// InvalidArgument naming the field for a null pointer, a bad size or a row stride too short;
// nothing is written then.
Status MergeAttention(const AttentionMergeArgs& args);

}  // namespace rubato
