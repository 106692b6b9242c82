// Qwen3 q/k-norm: RMSNorm over head_dim of every head of q or k, before RoPE.
#pragma once

namespace rubato {

// In place on x: every [head_dim] vector is RMS-normalized and scaled by weight.
//   x:      [tokens][heads][head_dim], f32
//   weight: [head_dim], f32 (self_attn.q_norm.weight or self_attn.k_norm.weight)
void HeadRmsNormInPlace(float* x, const float* weight, int tokens, int heads, int head_dim,
                        float eps);

}  // namespace rubato
