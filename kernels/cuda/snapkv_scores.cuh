// SnapKV-style prompt scoring on the GPU (the prompt compression of the LongFlow paper §4.1), one
// sequence per launch: each of the prompt's last `window` queries takes its causal softmax over
// positions [0, its own]; the weights on the prefix [0, length - window) are summed over the
// window and the GQA group's query heads, then max-pooled along positions (odd kernel, centred,
// clipped at the ends). CPU twin: kernels/cpu/snapkv_scores.h (same contract; f32 math here over
// bf16 inputs). Three small kernels: logits and softmax per (query head, window query), the sum
// per (KV head, position), the pooling.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct SnapKvScoresParams {
  // Window query w's head h at window_queries + w * q_row_stride + h * head_dim, bf16 (after
  // RoPE): the queries of positions [length - window, length), in position order.
  const __nv_bfloat16* window_queries = nullptr;
  int64_t q_row_stride = 0;
  int window = 0;  // >= 1, < length
  int num_heads = 0;
  const __nv_bfloat16* key_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
  int64_t num_pool_blocks = 0;
  const int32_t* block_table = nullptr;  // device: the sequence's blocks, covering `length`
  int num_kv_heads = 0;
  int head_dim = 0;  // 16, 32, 64, 128
  int block_tokens = 0;
  int length = 0;
  int pool_kernel = 1;        // odd, >= 1
  float* scores = nullptr;    // [num_kv_heads][scores_stride] out: first length - window
  int64_t scores_stride = 0;  // >= length - window
  void* workspace = nullptr;  // SnapKvScoresWorkspaceBytes(...), 16-byte aligned
  size_t workspace_bytes = 0;
};

// The softmax weights of every (query head, window query) and the summed prefix scores.
size_t SnapKvScoresWorkspaceBytes(int num_heads, int num_kv_heads, int window, int length);

// InvalidArgument naming the field for a bad shape or pointer. Never synchronizes.
Status SnapKvScores(const SnapKvScoresParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
