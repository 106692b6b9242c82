// The CUDA model's KV slot arrays (cuda_slot_kv_storage.h).
#include "inference_rank/model/cuda_slot_kv_storage.h"

#include <string>

#include "kernels/cuda/cuda_status.h"

namespace rubato {

size_t DeviceSlotKvStorage::PoolBytes(const SlotKvShape& s) {
  const size_t per_layer_array =
      2 * sizeof(__nv_bfloat16) * static_cast<size_t>(s.num_kv_heads) * s.budget * s.head_dim +
      static_cast<size_t>(s.budget) + sizeof(int32_t) * s.num_kv_heads;
  return per_layer_array * static_cast<size_t>(s.num_layers) * s.num_arrays;
}

Result<std::unique_ptr<DeviceSlotKvStorage>> DeviceSlotKvStorage::Create(const SlotKvShape& shape,
                                                                         cudaStream_t stream) {
  std::unique_ptr<DeviceSlotKvStorage> storage(new DeviceSlotKvStorage());
  storage->shape_ = shape;
  storage->stream_ = stream;
  storage->layer_elements_ =
      static_cast<size_t>(shape.num_arrays) * shape.num_kv_heads * shape.budget * shape.head_dim;
  const size_t layers = static_cast<size_t>(shape.num_layers);
  const size_t arrays = static_cast<size_t>(shape.num_arrays);
  const std::string what = "slot KV arrays (" + std::to_string(shape.num_arrays) + " requests x " +
                           std::to_string(shape.budget) + " slots x " +
                           std::to_string(shape.num_layers) + " layers, bf16; " +
                           std::to_string(PoolBytes(shape)) +
                           " bytes; lower the policy's budget or engine.max_batch)";
  RUBATO_ASSIGN_OR_RETURN(storage->keys_, cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                              storage->layer_elements_ * layers, "K of " + what));
  RUBATO_ASSIGN_OR_RETURN(storage->values_, cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                                storage->layer_elements_ * layers, "V of " + what));
  RUBATO_ASSIGN_OR_RETURN(storage->valid_, cuda::DeviceBuffer<uint8_t>::Allocate(
                                               layers * arrays * shape.budget, "masks of " + what));
  RUBATO_ASSIGN_OR_RETURN(storage->next_slot_,
                          cuda::DeviceBuffer<int32_t>::Allocate(
                              layers * arrays * shape.num_kv_heads, "next slots of " + what));
  // Zero everything (finite K/V in never-written slots; every mask clear, every next slot 0),
  // finished before any forward can read it.
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(storage->keys_.data(), 0, storage->keys_.bytes()),
                              "zeroing the slot K arrays");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(storage->values_.data(), 0, storage->values_.bytes()),
                              "zeroing the slot V arrays");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(storage->valid_.data(), 0, storage->valid_.bytes()),
                              "zeroing the slot masks");
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemset(storage->next_slot_.data(), 0, storage->next_slot_.bytes()),
      "zeroing the next slots");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "zeroing the KV slot arrays");
  return storage;
}

Status DeviceSlotKvStorage::ResetArray(int array) {
  if (array < 0 || array >= shape_.num_arrays) {
    return InternalError("KV slot storage: array " + std::to_string(array) + " outside [0, " +
                         std::to_string(shape_.num_arrays) + ")");
  }
  // One row per layer, strided by the layer's arrays.
  const size_t budget = static_cast<size_t>(shape_.budget);
  const size_t heads = static_cast<size_t>(shape_.num_kv_heads);
  const size_t arrays = static_cast<size_t>(shape_.num_arrays);
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemset2DAsync(valid_.data() + array * budget, arrays * budget, 0, budget,
                        static_cast<size_t>(shape_.num_layers), stream_),
      "clearing a KV slot mask");
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemset2DAsync(next_slot_.data() + array * heads, arrays * heads * sizeof(int32_t), 0,
                        heads * sizeof(int32_t), static_cast<size_t>(shape_.num_layers), stream_),
      "clearing next slots");
  return Status::Ok();
}

}  // namespace rubato
