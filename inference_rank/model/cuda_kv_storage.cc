// The CUDA model's device KV pools (cuda_kv_storage.h).
#include "inference_rank/model/cuda_kv_storage.h"

#include <string>

namespace rubato {

size_t DeviceKvStorage::PoolBytes(const KvCacheShape& shape) {
  return 2 * sizeof(__nv_bfloat16) * static_cast<size_t>(shape.num_layers) *
         static_cast<size_t>(shape.num_blocks) * static_cast<size_t>(shape.num_kv_heads) *
         static_cast<size_t>(shape.block_tokens) * static_cast<size_t>(shape.head_dim);
}

Result<std::unique_ptr<DeviceKvStorage>> DeviceKvStorage::Create(const KvCacheShape& shape) {
  std::unique_ptr<DeviceKvStorage> storage(new DeviceKvStorage());
  storage->shape_ = shape;
  storage->layer_elements_ = static_cast<size_t>(shape.num_blocks) * shape.num_kv_heads *
                             shape.block_tokens * shape.head_dim;
  const size_t elements = storage->layer_elements_ * static_cast<size_t>(shape.num_layers);
  const std::string what = "the KV cache (" + std::to_string(shape.num_blocks) + " blocks of " +
                           std::to_string(shape.block_tokens) + " tokens x " +
                           std::to_string(shape.num_layers) + " layers, bf16; " +
                           std::to_string(PoolBytes(shape)) + " bytes for K and V)";
  RUBATO_ASSIGN_OR_RETURN(storage->keys_,
                          cuda::DeviceBuffer<__nv_bfloat16>::Allocate(elements, "K of " + what));
  RUBATO_ASSIGN_OR_RETURN(storage->values_,
                          cuda::DeviceBuffer<__nv_bfloat16>::Allocate(elements, "V of " + what));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(storage->keys_.data(), 0, storage->keys_.bytes()),
                              "zeroing the K pool");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(storage->values_.data(), 0, storage->values_.bytes()),
                              "zeroing the V pool");
  // The memsets ran on the legacy default stream, which the model's non-blocking stream does
  // not wait for: finish them before any forward can touch the pools.
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "zeroing the KV pools");
  return storage;
}

}  // namespace rubato
