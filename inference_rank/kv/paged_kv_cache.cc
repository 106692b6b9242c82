// Paged KV cache: host pools, free list and block tables (see paged_kv_cache.h).
#include "inference_rank/kv/paged_kv_cache.h"

#include <algorithm>
#include <new>
#include <string>
#include <utility>

namespace rubato {

size_t PagedKvCache::PoolBytes(const KvCacheShape& shape) {
  return 2 * sizeof(float) * static_cast<size_t>(shape.num_layers) *
         static_cast<size_t>(shape.num_blocks) * static_cast<size_t>(shape.num_kv_heads) *
         static_cast<size_t>(shape.block_tokens) * static_cast<size_t>(shape.head_dim);
}

Status PagedKvCache::ValidateShape(const KvCacheShape& shape) {
  if (shape.block_tokens != 16 && shape.block_tokens != 64) {
    return InvalidArgumentError("KV cache: block size " + std::to_string(shape.block_tokens) +
                                " is not supported (engine.block_size must be 16 or 64)");
  }
  if (shape.num_layers <= 0 || shape.num_kv_heads <= 0 || shape.head_dim <= 0) {
    return InvalidArgumentError("KV cache: layers (" + std::to_string(shape.num_layers) +
                                "), KV heads (" + std::to_string(shape.num_kv_heads) +
                                ") and head_dim (" + std::to_string(shape.head_dim) +
                                ") must be positive");
  }
  if (shape.num_blocks <= 0) {
    return InvalidArgumentError("KV cache: the number of blocks must be positive, got " +
                                std::to_string(shape.num_blocks) + " (engine.max_kv_blocks)");
  }
  return Status::Ok();
}

void PagedKvCache::InitBlockAccounting() {
  free_blocks_.reserve(static_cast<size_t>(shape_.num_blocks));
  for (int block = shape_.num_blocks - 1; block >= 0; --block) free_blocks_.push_back(block);
  block_in_use_.assign(static_cast<size_t>(shape_.num_blocks), 0);
}

Result<std::unique_ptr<PagedKvCache>> PagedKvCache::Create(const KvCacheShape& shape) {
  RUBATO_RETURN_IF_ERROR(ValidateShape(shape));
  std::unique_ptr<PagedKvCache> cache(new PagedKvCache(shape));
  cache->layer_floats_ = static_cast<size_t>(shape.num_blocks) * shape.num_kv_heads *
                         shape.block_tokens * shape.head_dim;
  const size_t floats = cache->layer_floats_ * static_cast<size_t>(shape.num_layers);
  cache->keys_.reset(new (std::nothrow) float[floats]);
  cache->values_.reset(new (std::nothrow) float[floats]);
  if (!cache->keys_ || !cache->values_) {
    return ResourceExhaustedError(
        "KV cache: cannot allocate " + std::to_string(PoolBytes(shape) >> 20) + " MiB for " +
        std::to_string(shape.num_blocks) + " blocks of " + std::to_string(shape.block_tokens) +
        " tokens; lower engine.max_kv_blocks, engine.max_batch or engine.max_context");
  }
  cache->InitBlockAccounting();
  return cache;
}

Result<std::unique_ptr<PagedKvCache>> PagedKvCache::CreateWithStorage(
    const KvCacheShape& shape, std::unique_ptr<KvStorage> storage) {
  RUBATO_RETURN_IF_ERROR(ValidateShape(shape));
  if (storage == nullptr) return InvalidArgumentError("KV cache: no storage for the pools");
  std::unique_ptr<PagedKvCache> cache(new PagedKvCache(shape));
  cache->storage_ = std::move(storage);
  cache->InitBlockAccounting();
  return cache;
}

Status PagedKvCache::Reserve(KvSequence& sequence, int total_tokens) {
  const int needed = BlocksFor(total_tokens) - static_cast<int>(sequence.block_table.size());
  if (needed <= 0) return Status::Ok();
  if (needed > free_blocks()) {
    return ResourceExhaustedError("KV cache: " + std::to_string(total_tokens) + " tokens need " +
                                  std::to_string(needed) + " more blocks of " +
                                  std::to_string(shape_.block_tokens) + " tokens but only " +
                                  std::to_string(free_blocks()) + " of " +
                                  std::to_string(shape_.num_blocks) + " blocks are free");
  }
  for (int i = 0; i < needed; ++i) {
    const int32_t block = free_blocks_.back();
    free_blocks_.pop_back();
    block_in_use_[static_cast<size_t>(block)] = 1;
    sequence.block_table.push_back(block);
  }
  return Status::Ok();
}

Status PagedKvCache::Release(KvSequence& sequence) {
  for (int32_t block : sequence.block_table) {
    if (block == kReleasedBlock) continue;
    if (block < 0 || block >= shape_.num_blocks || !block_in_use_[static_cast<size_t>(block)]) {
      return InternalError("KV cache: releasing block " + std::to_string(block) +
                           ", which is not held by any sequence");
    }
  }
  for (int32_t block : sequence.block_table) {
    if (block == kReleasedBlock) continue;
    block_in_use_[static_cast<size_t>(block)] = 0;
    free_blocks_.push_back(block);
  }
  sequence.block_table.clear();
  sequence.num_tokens = 0;
  sequence.released_blocks = 0;
  return Status::Ok();
}

Status PagedKvCache::ReleaseBefore(KvSequence& sequence, int position) {
  // Entry b holds positions [b * bt, (b + 1) * bt): released when (b + 1) * bt <= position.
  const int end = std::min(std::max(position, 0) / shape_.block_tokens,
                           static_cast<int>(sequence.block_table.size()));
  for (int b = sequence.released_blocks; b < end; ++b) {
    const int32_t block = sequence.block_table[static_cast<size_t>(b)];
    if (block < 0 || block >= shape_.num_blocks || !block_in_use_[static_cast<size_t>(block)]) {
      return InternalError("KV cache: releasing block " + std::to_string(block) +
                           " (positions from " + std::to_string(b * shape_.block_tokens) +
                           "), which is not held by any sequence");
    }
  }
  for (int b = sequence.released_blocks; b < end; ++b) {
    int32_t& block = sequence.block_table[static_cast<size_t>(b)];
    block_in_use_[static_cast<size_t>(block)] = 0;
    free_blocks_.push_back(block);
    block = kReleasedBlock;
  }
  sequence.released_blocks = std::max(sequence.released_blocks, end);
  return Status::Ok();
}

int PagedKvCache::FirstReleasedPosition(const KvSequence& sequence, int begin, int end) const {
  if (sequence.released_blocks == 0 || begin >= end) return -1;
  const int first_held = sequence.released_blocks * shape_.block_tokens;
  return begin < first_held ? std::max(begin, 0) : -1;
}

PagedKvView PagedKvCache::LayerView(int layer, const KvSequence& sequence) const {
  if (!keys_) return PagedKvView{};  // pools held by storage_, not on the host
  const size_t offset = layer_floats_ * static_cast<size_t>(layer);
  return PagedKvView{keys_.get() + offset, values_.get() + offset, sequence.block_table.data(),
                     shape_.block_tokens,  shape_.num_kv_heads,    shape_.head_dim};
}

}  // namespace rubato
