// Tile-sparse prefill attention: a chunk of queries in tiles of `tile_tokens` absolute positions
// ([m t, (m + 1) t)); a query at position p of tile m attends, per KV head, the tile's list of
// earlier positions (any order, each once, all before the tile) and then every position of its
// own tile up to p, under one fp32 softmax, read in place from the paged KV. Same arithmetic as
// the dense rows path; the list [0, tile start) ascending gives rows-path dense attention bit
// for bit. Narrative: docs/kernels_cpu.md "Tile-sparse prefill attention".
#pragma once

#include <span>

#include "common/status.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct TileGatherAttentionArgs {
  const float* query = nullptr;  // [tokens][num_heads][head_dim], f32 (after RoPE)
  float* output = nullptr;       // [tokens][num_heads][head_dim], f32; not overlapping query
  int tokens = 0;                // >= 1 queries at positions start_position ..
  int start_position = 0;        // >= 0
  int num_heads = 0;             // a multiple of kv.num_kv_heads
  PagedKvView kv;                // block table covers [0, start_position + tokens)
  int tile_tokens = 0;           // >= 1
  // [tiles][num_kv_heads]: the chunk's tiles are those meeting [start, start + tokens), in order.
  const int* const* lists = nullptr;
  const int* counts = nullptr;
};

// The number of tiles a chunk meets.
int TileGatherTiles(int start_position, int tokens, int tile_tokens);

// OK when shapes agree, pointers are set and every list holds distinct positions before its
// tile's first position; InvalidArgument naming the field otherwise.
Status ValidateTileGatherAttention(const TileGatherAttentionArgs& args);

// Scratch floats of one TileGatherAttentionForKvHead call.
int TileGatherAttentionScratchSize(const TileGatherAttentionArgs& args);

// Every query's output for the query heads of KV head `kv_head`; KV heads may run on different
// threads. `args` must have passed validation; scratch is the calling thread's.
void TileGatherAttentionForKvHead(const TileGatherAttentionArgs& args, int kv_head, float* scratch);

Status TileGatherAttention(const TileGatherAttentionArgs& args, std::span<float> scratch);

}  // namespace rubato
