// CPU twin of the fused q/k-norm, RoPE and KV append (qk_rope_append.h): the separate CPU ops
// on gathered heads, scattered back.
#include "kernels/cpu/qk_rope_append.h"

#include <algorithm>
#include <vector>

#include "kernels/cpu/qk_norm.h"
#include "kernels/cpu/rope.h"

namespace rubato {

void QkNormRopeAppend(const QkRopeAppendArgs& a) {
  const int d = a.head_dim;
  const int rotated = a.num_heads + a.num_kv_heads;  // q and k heads, adjacent in a row
  std::vector<float> heads(static_cast<size_t>(a.tokens) * rotated * d);
  for (int t = 0; t < a.tokens; ++t) {
    std::copy_n(a.qkv + t * a.row_stride, rotated * d, heads.begin() + t * rotated * d);
  }
  if (a.q_norm_weight != nullptr) {
    std::vector<float> q(static_cast<size_t>(a.tokens) * a.num_heads * d);
    std::vector<float> k(static_cast<size_t>(a.tokens) * a.num_kv_heads * d);
    for (int t = 0; t < a.tokens; ++t) {
      const float* row = heads.data() + t * rotated * d;
      std::copy_n(row, a.num_heads * d, q.begin() + t * a.num_heads * d);
      std::copy_n(row + a.num_heads * d, a.num_kv_heads * d, k.begin() + t * a.num_kv_heads * d);
    }
    HeadRmsNormInPlace(q.data(), a.q_norm_weight, a.tokens, a.num_heads, d, a.eps);
    HeadRmsNormInPlace(k.data(), a.k_norm_weight, a.tokens, a.num_kv_heads, d, a.eps);
    for (int t = 0; t < a.tokens; ++t) {
      float* row = heads.data() + t * rotated * d;
      std::copy_n(q.begin() + t * a.num_heads * d, a.num_heads * d, row);
      std::copy_n(k.begin() + t * a.num_kv_heads * d, a.num_kv_heads * d, row + a.num_heads * d);
    }
  }
  std::vector<float> cos(static_cast<size_t>(a.tokens) * d / 2), sin(cos.size());
  RopeCosSin(a.positions, a.inv_freq, cos.data(), sin.data());
  ApplyRope(heads.data(), a.tokens, rotated, d, cos.data(), sin.data());
  for (int t = 0; t < a.tokens; ++t) {
    float* row = a.qkv + t * a.row_stride;
    std::copy_n(heads.begin() + t * rotated * d, rotated * d, row);
    const int32_t slot = a.slots[static_cast<size_t>(t)];
    if (slot < 0) continue;
    const int64_t block = slot / a.block_tokens;
    const int in_block = slot % a.block_tokens;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const int64_t dest = ((block * a.num_kv_heads + h) * a.block_tokens + in_block) * d;
      std::copy_n(row + (a.num_heads + h) * d, d, a.key_pool + dest);
      std::copy_n(row + (rotated + h) * d, d, a.value_pool + dest);
    }
  }
}

}  // namespace rubato
