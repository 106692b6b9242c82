// Index-gather sparse decode attention on the GPU: one query token per sequence attends, per KV
// head, a list of positions (any order, each once) read in place from the paged K/V through the
// block table; the dense decode attention's split kernel over a list key space (tensor cores,
// split-K, GQA-aware) and its merge. Kascade's reuse layers and its anchors' own pass.
// Graph-capturable: grids depend on batch, heads and the lists' capacity, never on the
// device-side counts. CPU twin: kernels/cpu/index_gather_attention.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct IndexGatherAttentionParams {
  // Query head h of sequence b at q + b * q_row_stride + h * head_dim, bf16 (after RoPE).
  const __nv_bfloat16* q = nullptr;
  int64_t q_row_stride = 0;
  const __nv_bfloat16* key_pool = nullptr;    // [blocks][num_kv_heads][block_tokens][head_dim]
  const __nv_bfloat16* value_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
  const int32_t* block_tables = nullptr;      // [batch][block_table_stride]
  int block_table_stride = 0;
  int batch = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;      // 32, 64, 128
  int block_tokens = 0;  // 16 or 64
  float scale = 0.f;     // usually 1 / sqrt(head_dim)
  // KV head h of sequence b attends positions lists[(b * list_heads + m(h)) * capacity + i] for
  // i < counts[b * list_heads + m(h)] (clamped to [0, capacity]), where m = head_map (device,
  // [num_kv_heads], values in [0, list_heads)) or the identity when null. Positions must be
  // in the sequence and distinct (not checked on the device).
  const int32_t* lists = nullptr;
  const int32_t* counts = nullptr;
  int capacity = 0;    // >= 1: fixes the grid
  int list_heads = 0;  // lists per sequence (the anchor's KV heads), >= 1
  const int32_t* head_map = nullptr;
  // Head h of sequence b written at out + b * out_row_stride + h * head_dim, bf16.
  __nv_bfloat16* out = nullptr;
  int64_t out_row_stride = 0;
  float* lse = nullptr;       // optional [batch][num_heads], natural log; -inf for an empty list
  void* workspace = nullptr;  // IndexGatherAttentionWorkspaceBytes(...), 16-byte aligned
  size_t workspace_bytes = 0;
  int num_splits = 0;  // 0: chosen from the shapes; capped at what the workspace holds
};

// The workspace of any launch with these shapes (whatever its split count).
size_t IndexGatherAttentionWorkspaceBytes(int batch, int num_heads, int head_dim, int capacity);

Status IndexGatherAttention(const IndexGatherAttentionParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
