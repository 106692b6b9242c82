// Causal prefill attention on the GPU: chunks of new query tokens of several sequences against
// their paged K/V (which already hold the chunks' own keys), tiled flash-attention style with
// an online softmax. CPU twin: kernels/cpu/attention.h (CausalAttention). The same kernel runs
// Kascade's tile-sparse prefill passes (PrefillMode; docs/kascade.md "Prefill"): CPU twins
// kernels/cpu/tile_gather_attention.h (kList) and the Kascade CPU backend's tile selection.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

// What a launch computes. kDense: the attention output (and each row's log-sum-exp when `lse` is
// set). Kascade's passes over selection tiles of `tile_tokens` absolute positions: kLse each
// row's log-sum-exp over every key it sees (Q K^T only, no output); kPool, from that lse, the
// post-softmax probabilities of each tile's rows summed per position before the tile; kList the
// output over each tile's list of earlier positions plus the tile's own causal part.
enum class PrefillMode { kDense, kLse, kPool, kList };

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
  int64_t out_row_stride = 0;    // (kDense, kList; unused by kLse and kPool)

  PrefillMode mode = PrefillMode::kDense;
  // [total_tokens][num_heads] f32, natural log: written by kLse (and kDense when set), read by
  // kPool.
  float* lse = nullptr;
  // Selection tiles (kLse, kPool, kList; these need the dense window): entry e's tiles are those
  // its rows meet, numbered from tile_base[e] in `pooled`, `lists` and `list_counts`; a negative
  // tile_base marks an entry outside the selection: kLse and kPool skip it, kList attends it
  // densely.
  int tile_tokens = 0;                 // a multiple of 64
  const int32_t* tile_base = nullptr;  // [entries], device
  // kPool: pooled[tile][kv_head][p] += sum over the tile's rows in the chunk and the GQA group of
  // exp(score - lse) for every position p before the tile (the caller zeroes it first).
  float* pooled = nullptr;
  int64_t pooled_stride = 0;  // >= every tile's first position
  // kList: tile t, KV head h attends lists[(t * list_heads + m) * list_capacity + j] for j <
  // list_counts[t * list_heads + m], m = head_map[h] (h when head_map is null): distinct
  // positions before the tile, any order (the count is clamped to [0, list_capacity]).
  const int32_t* lists = nullptr;
  const int32_t* list_counts = nullptr;
  int list_capacity = 0;
  int list_heads = 0;
  const int32_t* head_map = nullptr;  // [num_kv_heads], device, or null
};

Status PrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
