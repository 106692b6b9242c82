// Causal grouped-query attention of a chunk of new query tokens of one sequence against its
// paged K/V (which already holds the chunk's own keys and values), restricted to an attention
// window (attention_window.h; dense by default): scores q·k / sqrt(head_dim), fp32 softmax with
// the max subtracted; query head h reads KV head h / (num_heads / num_kv_heads). Serves prefill
// chunks and decode. Two paths with one contract (equal to fp32 rounding): rows (the reference,
// decode) and tiled (cblas_sgemm tiles, attention_tiled.cc; prefill).
// Narrative: docs/kernels_cpu.md "Causal paged attention".
#pragma once

#include "kernels/cpu/attention_window.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct CausalAttentionArgs {
  const float* queries = nullptr;  // [tokens][num_heads][head_dim], f32 (after RoPE)
  float* output = nullptr;         // [tokens][num_heads][head_dim], f32
  int tokens = 0;
  int start_position = 0;  // position of query token 0; the sequence holds >= start + tokens
  int num_heads = 0;       // query heads; a multiple of kv.num_kv_heads
  PagedKvView kv;          // only its shape fields matter to the *ScratchSize functions
  AttentionWindow window;  // which keys each query attends; dense by default
};

// Chunks of at least this many tokens take the tiled path.
inline constexpr int kTiledAttentionMinTokens = 4;

// Scratch floats one call of the rows path needs: the scores of one query row.
int RowsAttentionScratchSize(const CausalAttentionArgs& args);
// Scratch floats one call of the tiled path needs: query, key, value, score and accumulator
// tiles (independent of the context length).
int TiledAttentionScratchSize(const CausalAttentionArgs& args);
// Scratch floats CausalAttentionForKvHead / CausalAttention need (the larger of the two).
int CausalAttentionScratchSize(const CausalAttentionArgs& args);

// Compute the output of the query heads that read KV head `kv_head` (the GQA group), for all
// tokens. Groups write disjoint outputs, so different kv_heads may run on different threads.
//   scratch: [the matching *ScratchSize(args)], f32, owned by the calling thread
void RowsAttentionForKvHead(const CausalAttentionArgs& args, int kv_head, float* scratch);
void TiledAttentionForKvHead(const CausalAttentionArgs& args, int kv_head, float* scratch);
// The tiled path for tokens >= kTiledAttentionMinTokens, else the rows path.
void CausalAttentionForKvHead(const CausalAttentionArgs& args, int kv_head, float* scratch);

// All KV heads, one after the other.
void CausalAttention(const CausalAttentionArgs& args, float* scratch);

}  // namespace rubato
