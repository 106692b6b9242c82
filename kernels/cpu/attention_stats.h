// Softmax statistics of one decode query's attention, the CPU twin of the optional outputs of
// kernels/cuda/decode_attention.cuh: the log-sum-exp of each query head, and the attention
// probabilities of each KV head averaged over its GQA group (the evidence sparse policies such
// that selection policies read when they choose which positions to keep).
#pragma once

#include "kernels/cpu/attention_window.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct DecodeAttentionStatsArgs {
  const float* query = nullptr;  // [num_heads][head_dim], f32 (after RoPE)
  int seq_len = 0;               // keys [0, seq_len) in `kv`; the query sits at seq_len - 1
  int num_heads = 0;             // a multiple of kv.num_kv_heads
  float scale = 0.f;             // usually 1 / sqrt(head_dim)
  PagedKvView kv;
  AttentionWindow window;
};

// lse:   [num_heads], f32: log(sum over attended keys of exp(scale * q.k)), natural log
// probs: [num_kv_heads][seq_len], f32: mean over the group's heads of softmax probabilities;
//        0 for keys the window hides. Either output may be nullptr.
void DecodeAttentionStats(const DecodeAttentionStatsArgs& args, float* lse, float* probs);

}  // namespace rubato
