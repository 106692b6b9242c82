// The split-K merge of two partial attention results on the GPU: for each (row, head),
//   o = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b),   lse = log(e^lse_a + e^lse_b),
// computed against the larger lse; lse -inf marks an empty side, whose o is not read into the
// result; both empty give o = 0, lse -inf. Attention on the cache rank merges the cache rank's
// partial (decode attention over its positions, with `lse`) into the local segment's output.
// bf16 o in and out (what decode_attention.cuh writes), f32 math and lse. CPU twin:
// kernels/cpu/attention_merge.h (f32). Graph-capturable (grid from the shapes only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct AttentionMergeParams {
  // Head h of row r of side a at o_a + r * o_a_row_stride + h * head_dim, [head_dim] bf16; its
  // lse at lse_a[r * num_heads + h], f32, natural log, finite or -inf. Side b likewise.
  const __nv_bfloat16* o_a = nullptr;
  int64_t o_a_row_stride = 0;    // >= num_heads * head_dim, a multiple of 8
  const float* lse_a = nullptr;  // [rows][num_heads], device
  const __nv_bfloat16* o_b = nullptr;
  int64_t o_b_row_stride = 0;    // >= num_heads * head_dim, a multiple of 8
  const float* lse_b = nullptr;  // [rows][num_heads], device
  int rows = 0;                  // >= 0; 0 is a no-op
  int num_heads = 0;             // >= 1
  int head_dim = 0;              // a positive multiple of 8 (16-byte vectors)
  // Head h of row r of the result at out + r * out_row_stride + h * head_dim, bf16. May be o_a
  // or o_b with the same row stride (each element is read before it is written by one thread);
  // must not overlap them otherwise.
  __nv_bfloat16* out = nullptr;
  int64_t out_row_stride = 0;  // >= num_heads * head_dim, a multiple of 8
  // Optional [rows][num_heads], device, natural log; must not overlap lse_a or lse_b.
  float* lse_out = nullptr;
};

// o_a, o_b and out must be 16-byte aligned. InvalidArgument naming the field otherwise (nothing
// launched). Never synchronizes.
Status MergeAttention(const AttentionMergeParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
