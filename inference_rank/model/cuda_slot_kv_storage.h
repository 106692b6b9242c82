// The CUDA model's KV slot arrays (kv/slot_kv_pool.h): bf16 K and V, the validity
// masks and the next write slots, all on the device, behind SlotKvPool's SlotKvStorage.
// The pool keeps the accounting on the host (which request holds which array); the arrays live
// here, laid out so that one layer of every array is one contiguous block that the slot kernels
// index by array (an `arrays` step input per row, e.g. kernels/cuda/slot_writes.cuh):
//   keys, values: [layer][array][kv_head][budget][head_dim], bf16
//   valid:        [layer][array][budget], uint8
//   next_slot:    [layer][array][kv_head], int32
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/status.h"
#include "inference_rank/kv/slot_kv_pool.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

class DeviceSlotKvStorage : public SlotKvStorage {
 public:
  // Allocates the arrays on the current device, every slot invalid and every next slot 0.
  // ResetArray runs on `stream` (the model's), so that it is ordered before the forwards.
  // ResourceExhausted names the bytes asked for.
  static Result<std::unique_ptr<DeviceSlotKvStorage>> Create(const SlotKvShape& shape,
                                                             cudaStream_t stream);

  // Bytes of the arrays for `shape`, bf16 K and V.
  static size_t PoolBytes(const SlotKvShape& shape);

  size_t bytes() const override { return PoolBytes(shape_); }
  Status ResetArray(int array) override;

  const SlotKvShape& shape() const { return shape_; }
  // One layer of every array: [array][kv_head][budget][head_dim], bf16.
  __nv_bfloat16* layer_keys(int layer) { return keys_.data() + layer_elements_ * layer; }
  __nv_bfloat16* layer_values(int layer) { return values_.data() + layer_elements_ * layer; }
  // [array][budget] and [array][kv_head] of one layer.
  uint8_t* layer_valid(int layer) {
    return valid_.data() + static_cast<size_t>(layer) * shape_.num_arrays * shape_.budget;
  }
  int32_t* layer_next_slot(int layer) {
    return next_slot_.data() + static_cast<size_t>(layer) * shape_.num_arrays * shape_.num_kv_heads;
  }

 private:
  DeviceSlotKvStorage() = default;

  SlotKvShape shape_;
  cudaStream_t stream_ = nullptr;
  size_t layer_elements_ = 0;                 // arrays x kv_heads x budget x head_dim
  cuda::DeviceBuffer<__nv_bfloat16> keys_;    // [layer][array][kv_head][budget][head_dim]
  cuda::DeviceBuffer<__nv_bfloat16> values_;  // [layer][array][kv_head][budget][head_dim]
  cuda::DeviceBuffer<uint8_t> valid_;         // [layer][array][budget]
  cuda::DeviceBuffer<int32_t> next_slot_;     // [layer][array][kv_head]
};

}  // namespace rubato
