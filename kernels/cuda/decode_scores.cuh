// Raw decode scores without the attention: for each sequence's one query token, scale * q.k in
// LOG2 units (times log2 e) of every query head against every key position [0, L), reading the
// paged keys only (no values, no softmax): an anchor layer's scores pass when its own output
// comes from another op (Kascade). Same layout and units as DecodeAttentionParams::scores; the
// decode attention kernel's scores-only variant. Graph-capturable (grid from batch, heads and
// max_seq_len). CPU twin: scale * Dot(q, k) (kernels/cpu/dot.h) * log2 e.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct DecodeScoresParams {
  const __nv_bfloat16* q = nullptr;  // query head h of sequence b at q + b * q_row_stride + h * d
  int64_t q_row_stride = 0;
  const __nv_bfloat16* key_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
  // Blocks in the pool: > 0 lets head_dim 64 / 128 copy whole blocks through a tensor map (the
  // faster path; a block id past the pool reads zeros); 0: row copies, block ids trusted.
  int64_t num_pool_blocks = 0;
  const int32_t* block_tables = nullptr;  // [batch][block_table_stride]
  int block_table_stride = 0;
  const int32_t* seq_lens = nullptr;  // [batch], device, 1 <= L <= max_seq_len
  int batch = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // 16, 32, 64, 128
  int block_tokens = 0;
  int max_seq_len = 0;  // fixes the grid
  float scale = 0.f;
  float* scores = nullptr;    // [batch][num_heads][scores_stride]; [L, stride) left as they were
  int64_t scores_stride = 0;  // >= max_seq_len
  // Optional [batch][num_heads], natural log: log sum_p exp(scale q.k_p) over [0, L) (what a
  // pooled top-k of these scores takes as head_lse). Needs the workspace.
  float* lse = nullptr;
  void* workspace = nullptr;  // DecodeScoresWorkspaceBytes(...) bytes when lse is set
  size_t workspace_bytes = 0;
};

size_t DecodeScoresWorkspaceBytes(int batch, int num_heads, int max_seq_len);

Status DecodeScores(const DecodeScoresParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
