// LongFlow's fused decode attention and eviction choice on the GPU: per (sequence, KV head) one
// pass over its B slots gives the attention output of the GQA group, every slot's Eq. 6 score
// (the group's mean alpha times ||v||_1) and the slot the next token writes (the lowest free
// slot, else the least score past the sinks, ties low). One read of the slots (the decode
// attention split kernel over slot arrays, tensor cores), which also makes the choice when one
// split covers the slots; with several splits a small kernel makes it after the merge.
// fp32 exponentials with a tile-wise running maximum (no overflow; used_max reports where the
// twin's plain exponentials needed their fallback). CPU twin: kernels/cpu/longflow_attention.h
// (same contract). docs/longflow.md "The fused kernel".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct LongFlowAttentionParams {
  // Query head h of sequence b at q + b * q_row_stride + h * head_dim, bf16 (after RoPE).
  const __nv_bfloat16* q = nullptr;
  int64_t q_row_stride = 0;
  const __nv_bfloat16* keys = nullptr;    // [batch][num_kv_heads][budget][head_dim]: the slots
  const __nv_bfloat16* values = nullptr;  // [batch][num_kv_heads][budget][head_dim]
  const uint8_t* valid = nullptr;         // [batch][budget]
  int batch = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // 16, 32, 64, 128
  int budget = 0;    // B >= 1
  int sink_slots = 0;
  float scale = 0.f;
  __nv_bfloat16* out = nullptr;  // head h of sequence b at out + b * out_row_stride + h * d
  int64_t out_row_stride = 0;
  int32_t* next_slot = nullptr;  // [batch][num_kv_heads] out; -1 when no slot may be written
  float* slot_scores = nullptr;  // optional [batch][num_kv_heads][budget] out; 0 where invalid
  uint8_t* used_max = nullptr;   // optional [batch][num_kv_heads] out
  // Optional [batch], device: sequence b reads and writes the slot array arrays[b] (clamped to
  // [0, num_arrays)): keys / values are then [num_arrays][num_kv_heads][budget][head_dim], valid
  // [num_arrays][budget] and next_slot [num_arrays][num_kv_heads] (a pool of per-request slot
  // arrays, any subset in any row order); out, slot_scores and used_max stay indexed by b.
  const int32_t* arrays = nullptr;
  int num_arrays = 0;  // >= 1 with arrays
  // Key splits per (sequence, KV head): 0 chooses them from the shapes (one for a large batch,
  // the choice then made in the attention's own blocks); tests and benchmarks force 1 or more.
  int num_splits = 0;
  void* workspace = nullptr;  // LongFlowAttentionWorkspaceBytes(...), 16-byte aligned
  size_t workspace_bytes = 0;
};

size_t LongFlowAttentionWorkspaceBytes(int batch, int num_heads, int head_dim, int budget);

Status LongFlowAttention(const LongFlowAttentionParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
