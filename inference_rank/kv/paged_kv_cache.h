// The paged KV cache of an inference rank: block accounting for every backend (one free list
// shared by all layers, block tables, all-or-nothing Reserve / Release), and the host pools of
// the CPU backend. Pools per layer: [layer][block][kv_head][block_tokens][head_dim] (f32 host
// pools for Create; a backend's own, e.g. bf16 on the GPU, for CreateWithStorage); position p
// is row p % block_tokens of block block_table[p / block_tokens]. The cache never grows: running
// out of blocks is ResourceExhausted. Narrative: docs/engine_and_models.md "The paged KV cache".
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

// A block table entry whose block went back to the free list (PagedKvCache::ReleaseBefore): its
// positions are no longer held locally and must not be read or written.
inline constexpr int32_t kReleasedBlock = -1;

// One sequence's KV blocks. Owned by the caller (a request, a test); blocks are taken from and
// returned to one PagedKvCache through Reserve / Release / ReleaseBefore, never copied between
// caches.
struct KvSequence {
  std::vector<int32_t> block_table;  // [blocks] physical block ids (or kReleasedBlock), in
                                     // position order
  int num_tokens = 0;                // positions [0, num_tokens) hold K/V in every layer
                                     // (on evicting KV, once the prompt moved into the
                                     // request's slots: the positions written, no blocks)
  int released_blocks = 0;           // entries of block_table that are kReleasedBlock (a
                                     // prefix: ReleaseBefore releases from the front)
};

// Pools that a backend keeps outside this class (the CUDA model's device pools). The cache owns
// it and hands it back through storage(); the backend downcasts to its own type.
class KvStorage {
 public:
  virtual ~KvStorage() = default;
  // Bytes of the K and V pools it holds (what pool_bytes() reports).
  virtual size_t bytes() const = 0;
};

class PagedKvCache {
 public:
  // Validates the shape (positive sizes, block_tokens 16 or 64) and allocates f32 host pools;
  // ResourceExhausted when the allocation fails.
  static Result<std::unique_ptr<PagedKvCache>> Create(const KvCacheShape& shape);

  // Same validation, no host pools: `storage` (not null) holds the pools for `shape`, and this
  // cache only does the block accounting. LayerView must not be used on such a cache.
  static Result<std::unique_ptr<PagedKvCache>> CreateWithStorage(
      const KvCacheShape& shape, std::unique_ptr<KvStorage> storage);

  // Bytes of K and V pools for `shape` (what Create allocates).
  static size_t PoolBytes(const KvCacheShape& shape);

  // Makes `sequence` able to hold positions [0, total_tokens), taking blocks from the free
  // list. All or nothing: on ResourceExhausted no block is taken.
  Status Reserve(KvSequence& sequence, int total_tokens);

  // Returns every block of `sequence` to the free list and empties it (num_tokens = 0).
  // InternalError when a block is not one this cache handed out (a double release).
  Status Release(KvSequence& sequence);

  // Returns the blocks of `sequence` that hold only positions before `position` to the free
  // list; their block table entries become kReleasedBlock (the table keeps its length, so
  // position p still maps to entry p / block_tokens) and num_tokens is unchanged. Used where a
  // request's full KV lives elsewhere and this rank reads only a window of recent positions
  // (docs/residency.md "The local window"). InternalError on a block this cache did not hand out.
  Status ReleaseBefore(KvSequence& sequence, int position);

  // The first position of [begin, end) whose block `sequence` released, or -1 when every one is
  // held (or was never reserved: Capacity says that).
  int FirstReleasedPosition(const KvSequence& sequence, int begin, int end) const;

  // Blocks `sequence` holds (its table less the released entries).
  static int HeldBlocks(const KvSequence& sequence) {
    return static_cast<int>(sequence.block_table.size()) - sequence.released_blocks;
  }

  // Blocks needed to hold `tokens` positions.
  int BlocksFor(int tokens) const {
    return (tokens + shape_.block_tokens - 1) / shape_.block_tokens;
  }

  // Positions `sequence` can hold without reserving more.
  int Capacity(const KvSequence& sequence) const {
    return static_cast<int>(sequence.block_table.size()) * shape_.block_tokens;
  }

  // What the CPU ops read and write for `layer` of `sequence`. Valid until the sequence's
  // block table changes. A released position (FirstReleasedPosition) must not be read through it:
  // the model checks the positions an entry reads and writes before it does. Host pools only: a
  // cache made by CreateWithStorage has none and returns an empty view (null keys and values).
  PagedKvView LayerView(int layer, const KvSequence& sequence) const;

  // The backend's pools of a CreateWithStorage cache; nullptr for a cache with host pools.
  KvStorage* storage() { return storage_.get(); }
  const KvStorage* storage() const { return storage_.get(); }

  const KvCacheShape& shape() const { return shape_; }
  int free_blocks() const { return static_cast<int>(free_blocks_.size()); }
  int used_blocks() const { return shape_.num_blocks - free_blocks(); }
  // Bytes of the pools, wherever they are: the host pools, or storage()->bytes().
  size_t pool_bytes() const { return storage_ ? storage_->bytes() : PoolBytes(shape_); }

 private:
  explicit PagedKvCache(const KvCacheShape& shape) : shape_(shape) {}

  static Status ValidateShape(const KvCacheShape& shape);
  void InitBlockAccounting();

  KvCacheShape shape_;
  std::unique_ptr<KvStorage> storage_;  // the backend's pools, or null for host pools
  size_t layer_floats_ = 0;             // floats of one layer's pool: blocks x kv_heads x bt x hd
  // Host pools (Create only): [layer][block][kv_head][block_tokens][head_dim], f32
  std::unique_ptr<float[]> keys_;
  std::unique_ptr<float[]> values_;
  std::vector<int32_t> free_blocks_;   // stack of free block ids; lowest ids handed out first
  std::vector<uint8_t> block_in_use_;  // [num_blocks] 1 while a sequence holds the block
};

}  // namespace rubato
