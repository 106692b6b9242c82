// Rotary position embedding (RoPE) in the Hugging Face layout: the rotated pairs are
// (i, i + head_dim/2) ("rotate_half", non-interleaved), as in LlamaRotaryEmbedding and
// apply_rotary_pos_emb of transformers' Llama / Qwen2 / Qwen3 modelling code.
//
// Three steps: inverse frequencies once per model (default or "llama3" scaling), cos/sin once
// per forward for the positions of its tokens, then the rotation of q and k of every layer.
#pragma once

#include <span>
#include <vector>

#include "common/hf_config.h"

namespace rubato {

// inv_freq[i] for i in [0, head_dim/2), fp32, computed with the same fp32 operations as
// transformers' _compute_default_rope_parameters (1 / theta^(2i / head_dim)) followed, for
// RopeScaling::Type::kLlama3, by _compute_llama3_parameters (low frequencies divided by
// `factor`, high ones kept, the band between smoothly interpolated). head_dim must be even.
std::vector<float> RopeInverseFrequencies(int head_dim, double rope_theta,
                                          const RopeScaling& scaling);

// cos/sin of the rotation angles of each token: angle[t][i] = float(positions[t]) * inv_freq[i]
// rounded to fp32 (torch computes it as an fp32 product), then cos/sin of that fp32 angle.
//   positions: [tokens]
//   inv_freq:  [head_dim/2], f32
//   cos, sin:  [tokens][head_dim/2], f32
void RopeCosSin(std::span<const int> positions, std::span<const float> inv_freq, float* cos,
                float* sin);

// Rotates every head of x in place: for i < half = head_dim/2,
//   x'[i]        = x[i] * cos[i] - x[i + half] * sin[i]
//   x'[i + half] = x[i + half] * cos[i] + x[i] * sin[i]
//   x:        [tokens][heads][head_dim], f32
//   cos, sin: [tokens][head_dim/2], f32 (from RopeCosSin)
void ApplyRope(float* x, int tokens, int heads, int head_dim, const float* cos, const float* sin);

}  // namespace rubato
