// The evicting KV residency's storage (DESIGN §3 "KV residency"): per request a static array of
// `budget` slots per (layer, KV head), taken from a pool allocated once (no growth, no
// fragmentation) and handed back when the request ends. A slot holds one token's K and V; a
// validity mask per layer (shared by the KV heads) says which slots hold a token, and
// `next_slot` per (layer, KV head) where the request's next token is written (chosen by the
// attention of the step before). Which token a slot holds is the attention policy's business.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"

namespace rubato {

struct EvictingKvShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int budget = 0;      // B: slots per (layer, KV head) of one request
  int num_arrays = 0;  // requests the pool can hold at once
};

// One request's slot arrays (an index into its pool); -1 while it holds none.
struct EvictingKvSlots {
  int array = -1;
};

class EvictingKvPool;

// What a forward entry on evicting KV carries (model.h ForwardEntry::evicting).
struct EvictingForward {
  EvictingKvPool* pool = nullptr;
  EvictingKvSlots slots;
};

// One layer of one request's slot arrays.
struct EvictingKvView {
  float* keys = nullptr;         // [num_kv_heads][budget][head_dim], f32
  float* values = nullptr;       // [num_kv_heads][budget][head_dim], f32
  uint8_t* valid = nullptr;      // [budget]: 1 where the slot holds a token (every KV head's)
  int32_t* next_slot = nullptr;  // [num_kv_heads]: where the next token's K/V go
  int num_kv_heads = 0;
  int budget = 0;
  int head_dim = 0;

  float* Key(int kv_head, int slot) const {
    return keys + (static_cast<size_t>(kv_head) * budget + slot) * head_dim;
  }
  float* Value(int kv_head, int slot) const {
    return values + (static_cast<size_t>(kv_head) * budget + slot) * head_dim;
  }
};

// Writes one token's K/V ([num_kv_heads][head_dim] each) into slot next_slot[h] of every KV head
// h and marks the slot valid. InvalidArgument when a next slot lies outside [0, budget).
Status WriteToNextSlots(const EvictingKvView& view, const float* key, const float* value);

// Slot arrays that a backend keeps outside this class (the CUDA model's device arrays). The pool
// owns it and hands it back through storage(); the backend downcasts to its own type.
class EvictingKvStorage {
 public:
  virtual ~EvictingKvStorage() = default;
  // Bytes of the keys, values, masks and next slots it holds (what pool_bytes() reports).
  virtual size_t bytes() const = 0;
  // Every slot of `array` invalid and every next slot 0, in every layer (what Reserve promises);
  // may be asynchronous, ordered before the backend's next forward.
  virtual Status ResetArray(int array) = 0;
};

class EvictingKvPool {
 public:
  // Validates the shape (positive sizes) and allocates f32 host pools; ResourceExhausted when
  // the allocation fails.
  static Result<std::unique_ptr<EvictingKvPool>> Create(const EvictingKvShape& shape);

  // Same validation, no host arrays: `storage` (not null) holds the arrays for `shape`, and this
  // pool only does the accounting (Reserve / Release). LayerView must not be used on such a pool.
  static Result<std::unique_ptr<EvictingKvPool>> CreateWithStorage(
      const EvictingKvShape& shape, std::unique_ptr<EvictingKvStorage> storage);

  // Bytes of K, V, masks and next slots for `shape` (what Create allocates).
  static size_t PoolBytes(const EvictingKvShape& shape);

  // Gives `slots` a free array: every slot invalid, every next slot 0. ResourceExhausted when
  // all arrays are held; InvalidArgument when `slots` already holds one.
  Status Reserve(EvictingKvSlots& slots);
  // Hands the array back (a no-op for slots that hold none). InternalError for an array this
  // pool did not hand out.
  Status Release(EvictingKvSlots& slots);

  // What the CPU ops read and write for `layer` of `slots`. Host arrays only: a pool made by
  // CreateWithStorage returns an empty view (null pointers).
  EvictingKvView LayerView(int layer, const EvictingKvSlots& slots) const;

  const EvictingKvShape& shape() const { return shape_; }
  int free_arrays() const { return static_cast<int>(free_arrays_.size()); }
  size_t pool_bytes() const { return storage_ != nullptr ? storage_->bytes() : PoolBytes(shape_); }
  EvictingKvStorage* storage() const { return storage_.get(); }  // null: host arrays

 private:
  explicit EvictingKvPool(const EvictingKvShape& shape) : shape_(shape) {}

  EvictingKvShape shape_;
  size_t layer_floats_ = 0;        // floats of one layer's K (or V) of one array: kv_heads x B x hd
  std::unique_ptr<float[]> keys_;  // [array][layer][kv_head][budget][head_dim], f32
  std::unique_ptr<float[]> values_;             // [array][layer][kv_head][budget][head_dim], f32
  std::unique_ptr<uint8_t[]> valid_;            // [array][layer][budget]
  std::unique_ptr<int32_t[]> next_;             // [array][layer][kv_head]
  std::vector<int32_t> free_arrays_;            // stack; lowest ids handed out first
  std::vector<uint8_t> array_in_use_;           // [num_arrays]
  std::unique_ptr<EvictingKvStorage> storage_;  // set: the arrays live there, not above
};

}  // namespace rubato
