// Causal prefill attention on the GPU: chunks of new query tokens of several sequences against
// their paged K/V (which already hold the chunks' own keys), tiled flash-attention style with
// an online softmax. CPU twin: kernels/cpu/attention.h (CausalAttention).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct PrefillAttentionParams {
  // Query head h of token row t at q + t * q_row_stride + h * head_dim, bf16 (after RoPE). The
  // rows of entry e are [query_start[e], query_start[e + 1]).
  const __nv_bfloat16* q = nullptr;
  int64_t q_row_stride = 0;
  const __nv_bfloat16* key_pool = nullptr;    // [blocks][num_kv_heads][block_tokens][head_dim]
  const __nv_bfloat16* value_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
  const int32_t* block_tables = nullptr;      // [entries][block_table_stride]
  int block_table_stride = 0;
  const int32_t* query_start = nullptr;     // [entries + 1], device
  const int32_t* start_position = nullptr;  // [entries], device: position of each first row
  int entries = 0;
  int total_tokens = 0;      // query_start[entries]
  int max_query_tokens = 0;  // largest entry (sizes the grid)
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;      // 16, 32, 64, 128
  int block_tokens = 0;  // 16 or 64
  float scale = 0.f;
  // Row at position p attends keys [0, min(sink, p + 1)) ∪ [max(sink, p - recent + 1), p]
  // (kernels/cpu/attention_window.h); dense is sink = 0, recent = unbounded.
  int sink_tokens = 0;
  int recent_tokens = INT_MAX;
  __nv_bfloat16* out = nullptr;  // head h of row t at out + t * out_row_stride + h * head_dim
  int64_t out_row_stride = 0;
};

Status PrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
