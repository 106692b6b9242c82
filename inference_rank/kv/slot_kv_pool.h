// Slot arrays, a KV storage of fixed size per request (the storage of the `evicting` residency,
// inference_rank/residency/evicting/): per request a static array of `budget` slots per
// (layer, KV head), taken from a pool allocated once (no growth, no
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

struct SlotKvShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int budget = 0;      // B: slots per (layer, KV head) of one request
  int num_arrays = 0;  // requests the pool can hold at once
};

// One request's slot arrays (an index into its pool); -1 while it holds none.
struct SlotKvArrays {
  int array = -1;
};

class SlotKvPool;

// What a forward entry whose K/V go to slot arrays carries (model.h ForwardEntry::slots).
struct SlotKvForward {
  SlotKvPool* pool = nullptr;
  SlotKvArrays arrays;
};

// One layer of one request's slot arrays.
struct SlotKvView {
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
Status WriteToNextSlots(const SlotKvView& view, const float* key, const float* value);

// Slot arrays that a backend keeps outside this class (the CUDA model's device arrays). The pool
// owns it and hands it back through storage(); the backend downcasts to its own type.
class SlotKvStorage {
 public:
  virtual ~SlotKvStorage() = default;
  // Bytes of the keys, values, masks and next slots it holds (what pool_bytes() reports).
  virtual size_t bytes() const = 0;
  // Every slot of `array` invalid and every next slot 0, in every layer (what Reserve promises);
  // may be asynchronous, ordered before the backend's next forward.
  virtual Status ResetArray(int array) = 0;
};

class SlotKvPool {
 public:
  // Validates the shape (positive sizes) and allocates f32 host pools; ResourceExhausted when
  // the allocation fails.
  static Result<std::unique_ptr<SlotKvPool>> Create(const SlotKvShape& shape);

  // Same validation, no host arrays: `storage` (not null) holds the arrays for `shape`, and this
  // pool only does the accounting (Reserve / Release). LayerView must not be used on such a pool.
  static Result<std::unique_ptr<SlotKvPool>> CreateWithStorage(
      const SlotKvShape& shape, std::unique_ptr<SlotKvStorage> storage);

  // Bytes of K, V, masks and next slots for `shape` (what Create allocates).
  static size_t PoolBytes(const SlotKvShape& shape);

  // Gives `slots` a free array: every slot invalid, every next slot 0. ResourceExhausted when
  // all arrays are held; InvalidArgument when `slots` already holds one.
  Status Reserve(SlotKvArrays& slots);
  // Hands the array back (a no-op for slots that hold none). InternalError for an array this
  // pool did not hand out.
  Status Release(SlotKvArrays& slots);

  // What the CPU ops read and write for `layer` of `slots`. Host arrays only: a pool made by
  // CreateWithStorage returns an empty view (null pointers).
  SlotKvView LayerView(int layer, const SlotKvArrays& slots) const;

  const SlotKvShape& shape() const { return shape_; }
  int free_arrays() const { return static_cast<int>(free_arrays_.size()); }
  size_t pool_bytes() const { return storage_ != nullptr ? storage_->bytes() : PoolBytes(shape_); }
  SlotKvStorage* storage() const { return storage_.get(); }  // null: host arrays

 private:
  explicit SlotKvPool(const SlotKvShape& shape) : shape_(shape) {}

  SlotKvShape shape_;
  size_t layer_floats_ = 0;        // floats of one layer's K (or V) of one array: kv_heads x B x hd
  std::unique_ptr<float[]> keys_;  // [array][layer][kv_head][budget][head_dim], f32
  std::unique_ptr<float[]> values_;         // [array][layer][kv_head][budget][head_dim], f32
  std::unique_ptr<uint8_t[]> valid_;        // [array][layer][budget]
  std::unique_ptr<int32_t[]> next_;         // [array][layer][kv_head]
  std::vector<int32_t> free_arrays_;        // stack; lowest ids handed out first
  std::vector<uint8_t> array_in_use_;       // [num_arrays]
  std::unique_ptr<SlotKvStorage> storage_;  // set: the arrays live there, not above
};

}  // namespace rubato
