// Causal grouped-query attention of a chunk of new query tokens of one sequence against that
// sequence's paged K/V (which already holds the chunk's own keys and values).
//
// Query token t sits at position start_position + t and attends positions
// [0, start_position + t]: scores = q·k / sqrt(head_dim), softmax in fp32 with the max
// subtracted, output = sum of probabilities x values. Query head h reads KV head
// h / (num_heads / num_kv_heads), as transformers' repeat_kv. The same op serves prefill
// chunks (tokens > 1) and decode (tokens == 1).
#pragma once

#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct CausalAttentionArgs {
  const float* queries = nullptr;  // [tokens][num_heads][head_dim], f32 (after RoPE)
  float* output = nullptr;         // [tokens][num_heads][head_dim], f32
  int tokens = 0;
  int start_position = 0;  // position of query token 0; the sequence holds >= start + tokens
  int num_heads = 0;       // query heads; a multiple of kv.num_kv_heads
  PagedKvView kv;
};

// Scratch floats one call needs: the scores of one query row.
inline int CausalAttentionScratchSize(const CausalAttentionArgs& args) {
  return args.start_position + args.tokens;
}

// Computes the output of the query heads that read KV head `kv_head` (the GQA group), for all
// tokens. Groups write disjoint outputs, so different kv_heads may run on different threads.
//   scratch: [CausalAttentionScratchSize(args)], f32, owned by the calling thread
void CausalAttentionForKvHead(const CausalAttentionArgs& args, int kv_head, float* scratch);

// All KV heads, one after the other.
void CausalAttention(const CausalAttentionArgs& args, float* scratch);

}  // namespace rubato
