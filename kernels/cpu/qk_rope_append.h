// The fused q/k-norm, RoPE and KV append of a layer (CPU twin of cuda::QkNormRopeAppend):
// HeadRmsNormInPlace on the q and the k heads (when the weights are set), ApplyRope on both, then
// k and v copied into the paged pools at each token's slot. f32 throughout.
#pragma once

#include <cstdint>
#include <span>

namespace rubato {

struct QkRopeAppendArgs {
  float* qkv = nullptr;  // [tokens][row_stride]: q heads | k heads | v heads
  int64_t row_stride = 0;
  int tokens = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  const float* q_norm_weight = nullptr;  // [head_dim] each, or both null
  const float* k_norm_weight = nullptr;
  float eps = 0;
  std::span<const int> positions;   // [tokens]
  std::span<const float> inv_freq;  // [head_dim / 2]
  std::span<const int32_t> slots;   // [tokens]; negative: not appended
  int block_tokens = 0;
  float* key_pool = nullptr;    // [blocks][num_kv_heads][block_tokens][head_dim]
  float* value_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
};

void QkNormRopeAppend(const QkRopeAppendArgs& args);

}  // namespace rubato
