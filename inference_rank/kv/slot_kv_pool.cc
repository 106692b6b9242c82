// The KV slot pool (see slot_kv_pool.h).
#include "inference_rank/kv/slot_kv_pool.h"

#include <algorithm>
#include <new>
#include <string>
#include <utility>

namespace rubato {

Status WriteToNextSlots(const SlotKvView& view, const float* key, const float* value) {
  for (int h = 0; h < view.num_kv_heads; ++h) {
    const int slot = view.next_slot[h];
    if (slot < 0 || slot >= view.budget) {
      return InvalidArgumentError("evicting KV: KV head " + std::to_string(h) +
                                  " has no slot to write (next slot " + std::to_string(slot) +
                                  ", budget " + std::to_string(view.budget) + ")");
    }
  }
  const size_t row = static_cast<size_t>(view.head_dim);
  for (int h = 0; h < view.num_kv_heads; ++h) {
    const int slot = view.next_slot[h];
    std::copy(key + h * row, key + (h + 1) * row, view.Key(h, slot));
    std::copy(value + h * row, value + (h + 1) * row, view.Value(h, slot));
    view.valid[slot] = 1;
  }
  return Status::Ok();
}

size_t SlotKvPool::PoolBytes(const SlotKvShape& s) {
  const size_t per_layer =
      2 * sizeof(float) * static_cast<size_t>(s.num_kv_heads) * s.budget * s.head_dim + s.budget +
      sizeof(int32_t) * s.num_kv_heads;
  return per_layer * s.num_layers * s.num_arrays;
}

namespace {

Status ValidateShape(const SlotKvShape& shape) {
  if (shape.num_layers <= 0 || shape.num_kv_heads <= 0 || shape.head_dim <= 0 ||
      shape.budget <= 0 || shape.num_arrays <= 0) {
    return InvalidArgumentError("evicting KV pool: layers (" + std::to_string(shape.num_layers) +
                                "), KV heads (" + std::to_string(shape.num_kv_heads) +
                                "), head_dim (" + std::to_string(shape.head_dim) + "), budget (" +
                                std::to_string(shape.budget) + ") and arrays (" +
                                std::to_string(shape.num_arrays) + ") must be positive");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<SlotKvPool>> SlotKvPool::CreateWithStorage(
    const SlotKvShape& shape, std::unique_ptr<SlotKvStorage> storage) {
  RUBATO_RETURN_IF_ERROR(ValidateShape(shape));
  if (storage == nullptr) return InvalidArgumentError("evicting KV pool: no storage given");
  std::unique_ptr<SlotKvPool> pool(new SlotKvPool(shape));
  pool->storage_ = std::move(storage);
  for (int array = shape.num_arrays - 1; array >= 0; --array) pool->free_arrays_.push_back(array);
  pool->array_in_use_.assign(static_cast<size_t>(shape.num_arrays), 0);
  return pool;
}

Result<std::unique_ptr<SlotKvPool>> SlotKvPool::Create(const SlotKvShape& shape) {
  RUBATO_RETURN_IF_ERROR(ValidateShape(shape));
  std::unique_ptr<SlotKvPool> pool(new SlotKvPool(shape));
  pool->layer_floats_ = static_cast<size_t>(shape.num_kv_heads) * shape.budget * shape.head_dim;
  const size_t layers = static_cast<size_t>(shape.num_arrays) * shape.num_layers;
  pool->keys_.reset(new (std::nothrow) float[pool->layer_floats_ * layers]);
  pool->values_.reset(new (std::nothrow) float[pool->layer_floats_ * layers]);
  pool->valid_.reset(new (std::nothrow) uint8_t[layers * shape.budget]());
  pool->next_.reset(new (std::nothrow) int32_t[layers * shape.num_kv_heads]());
  if (!pool->keys_ || !pool->values_ || !pool->valid_ || !pool->next_) {
    return ResourceExhaustedError(
        "evicting KV pool: cannot allocate " + std::to_string(PoolBytes(shape) >> 20) +
        " MiB for " + std::to_string(shape.num_arrays) + " requests of " +
        std::to_string(shape.budget) + " slots; lower the policy's budget or engine.max_batch");
  }
  for (int array = shape.num_arrays - 1; array >= 0; --array) pool->free_arrays_.push_back(array);
  pool->array_in_use_.assign(static_cast<size_t>(shape.num_arrays), 0);
  return pool;
}

Status SlotKvPool::Reserve(SlotKvArrays& slots) {
  if (slots.array >= 0) {
    return InvalidArgumentError("evicting KV pool: the request already holds slot array " +
                                std::to_string(slots.array));
  }
  if (free_arrays_.empty()) {
    return ResourceExhaustedError("evicting KV pool: all " + std::to_string(shape_.num_arrays) +
                                  " slot arrays of " + std::to_string(shape_.budget) +
                                  " slots are held");
  }
  const int array = free_arrays_.back();
  if (storage_ != nullptr) {
    RUBATO_RETURN_IF_ERROR(storage_->ResetArray(array));
  } else {
    const size_t layers = static_cast<size_t>(shape_.num_layers);
    std::fill_n(valid_.get() + array * layers * shape_.budget, layers * shape_.budget, uint8_t{0});
    std::fill_n(next_.get() + array * layers * shape_.num_kv_heads, layers * shape_.num_kv_heads,
                0);
  }
  free_arrays_.pop_back();
  array_in_use_[static_cast<size_t>(array)] = 1;
  slots.array = array;
  return Status::Ok();
}

Status SlotKvPool::Release(SlotKvArrays& slots) {
  if (slots.array < 0) return Status::Ok();
  if (slots.array >= shape_.num_arrays || !array_in_use_[static_cast<size_t>(slots.array)]) {
    return InternalError("evicting KV pool: slot array " + std::to_string(slots.array) +
                         " is not held (a double release)");
  }
  array_in_use_[static_cast<size_t>(slots.array)] = 0;
  free_arrays_.push_back(slots.array);
  slots.array = -1;
  return Status::Ok();
}

SlotKvView SlotKvPool::LayerView(int layer, const SlotKvArrays& slots) const {
  if (storage_ != nullptr) return SlotKvView{};
  const size_t index = static_cast<size_t>(slots.array) * shape_.num_layers + layer;
  SlotKvView view;
  view.keys = keys_.get() + index * layer_floats_;
  view.values = values_.get() + index * layer_floats_;
  view.valid = valid_.get() + index * shape_.budget;
  view.next_slot = next_.get() + index * shape_.num_kv_heads;
  view.num_kv_heads = shape_.num_kv_heads;
  view.budget = shape_.budget;
  view.head_dim = shape_.head_dim;
  return view;
}

}  // namespace rubato
