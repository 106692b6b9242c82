// The paged KV cache of the CPU backend (DESIGN §3).
//
// For every layer, K and V live in pools of fixed-size blocks laid out
//   [layer][block][kv_head][block_tokens][head_dim], f32
// A sequence owns a block table (physical block ids in position order); position p of the
// sequence is row p % block_tokens of block block_table[p / block_tokens]. Blocks come from one
// free list shared by all layers: a block id names the same slot in every layer's pool.
//
// The cache never grows: running out of blocks is a ResourceExhausted error, never a crash.
// The pools are allocated untouched (the OS maps pages on first write), so a cache sized for
// max_batch x max_context only costs memory as sequences fill it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct KvCacheShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 16;  // 16 or 64
  int num_blocks = 0;
};

// One sequence's KV blocks. Owned by the caller (a request, a test); blocks are taken from and
// returned to one PagedKvCache through Reserve / Release, never copied between caches.
struct KvSequence {
  std::vector<int32_t> block_table;  // [blocks] physical block ids, in position order
  int num_tokens = 0;                // positions [0, num_tokens) hold K/V in every layer
};

class PagedKvCache {
 public:
  // Validates the shape (positive sizes, block_tokens 16 or 64) and allocates the pools;
  // ResourceExhausted when the allocation fails.
  static Result<std::unique_ptr<PagedKvCache>> Create(const KvCacheShape& shape);

  // Bytes of K and V pools for `shape` (what Create allocates).
  static size_t PoolBytes(const KvCacheShape& shape);

  // Makes `sequence` able to hold positions [0, total_tokens), taking blocks from the free
  // list. All or nothing: on ResourceExhausted no block is taken.
  Status Reserve(KvSequence& sequence, int total_tokens);

  // Returns every block of `sequence` to the free list and empties it (num_tokens = 0).
  // InternalError when a block is not one this cache handed out (a double release).
  Status Release(KvSequence& sequence);

  // Blocks needed to hold `tokens` positions.
  int BlocksFor(int tokens) const {
    return (tokens + shape_.block_tokens - 1) / shape_.block_tokens;
  }

  // Positions `sequence` can hold without reserving more.
  int Capacity(const KvSequence& sequence) const {
    return static_cast<int>(sequence.block_table.size()) * shape_.block_tokens;
  }

  // What the CPU ops read and write for `layer` of `sequence`. Valid until the sequence's
  // block table changes.
  PagedKvView LayerView(int layer, const KvSequence& sequence) const;

  const KvCacheShape& shape() const { return shape_; }
  int free_blocks() const { return static_cast<int>(free_blocks_.size()); }
  int used_blocks() const { return shape_.num_blocks - free_blocks(); }
  size_t pool_bytes() const { return PoolBytes(shape_); }

 private:
  explicit PagedKvCache(const KvCacheShape& shape) : shape_(shape) {}

  KvCacheShape shape_;
  size_t layer_floats_ = 0;            // floats of one layer's pool: blocks x kv_heads x bt x hd
  std::unique_ptr<float[]> keys_;      // [layer][block][kv_head][block_tokens][head_dim], f32
  std::unique_ptr<float[]> values_;    // [layer][block][kv_head][block_tokens][head_dim], f32
  std::vector<int32_t> free_blocks_;   // stack of free block ids; lowest ids handed out first
  std::vector<uint8_t> block_in_use_;  // [num_blocks] 1 while a sequence holds the block
};

}  // namespace rubato
