// The inference rank's device compact pools (device_compact_pools.h): allocation, the free list,
// the delta scatter and the compact segment of the attention.
#include "inference_rank/residency/offloaded/device_compact_pools.h"

#include <fmt/format.h>

#include "kernels/cuda/compact_delta_scatter.cuh"
#include "kernels/cuda/cuda_status.h"

namespace rubato {

Result<std::unique_ptr<DeviceCompactPools>> DeviceCompactPools::Create(
    const DeviceCompactPoolsOptions& o) {
  if (o.num_layers < 1 || o.num_kv_heads < 1 || o.head_dim < 8 || o.head_dim % 8 != 0 ||
      o.capacity < 1 || o.max_requests < 1) {
    return InvalidArgumentError(fmt::format(
        "device compact pools: num_layers {}, num_kv_heads {}, head_dim {}, capacity {}, "
        "max_requests {}: need positive sizes and head_dim a multiple of 8",
        o.num_layers, o.num_kv_heads, o.head_dim, o.capacity, o.max_requests));
  }
  std::unique_ptr<DeviceCompactPools> pools(new DeviceCompactPools());
  pools->options_ = o;
  const size_t slots = static_cast<size_t>(o.num_layers) * o.max_requests * o.num_kv_heads *
                       static_cast<size_t>(o.capacity);
  const size_t rows = slots * static_cast<size_t>(o.head_dim);
  RUBATO_ASSIGN_OR_RETURN(
      pools->keys_, cuda::DeviceBuffer<__nv_bfloat16>::Allocate(rows, "the compact pools' K rows"));
  RUBATO_ASSIGN_OR_RETURN(pools->values_, cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                              rows, "the compact pools' V rows"));
  RUBATO_ASSIGN_OR_RETURN(pools->counts_,
                          cuda::DeviceBuffer<int32_t>::Allocate(
                              static_cast<size_t>(o.num_layers) * o.max_requests * o.num_kv_heads,
                              "the compact pools' counts"));
  RUBATO_ASSIGN_OR_RETURN(pools->positions_, cuda::DeviceBuffer<int32_t>::Allocate(
                                                 slots, "the compact pools' positions"));
  // Zeroed rows and counts: a pool attended before its first delta (a caller bug) reads no rows.
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(pools->keys_.data(), 0, pools->keys_.bytes()),
                              "zeroing the compact pools");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(pools->values_.data(), 0, pools->values_.bytes()),
                              "zeroing the compact pools");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(pools->counts_.data(), 0, pools->counts_.bytes()),
                              "zeroing the compact pools");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(pools->positions_.data(), 0xFF, pools->positions_.bytes()),
                              "emptying the compact pools' positions");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "allocating the compact pools");
  for (int p = o.max_requests - 1; p >= 0; --p) pools->free_.push_back(p);
  pools->in_use_.assign(static_cast<size_t>(o.max_requests), false);
  return pools;
}

Result<int> DeviceCompactPools::Acquire() {
  if (free_.empty()) {
    return ResourceExhaustedError(fmt::format(
        "device compact pools: all max_requests {} pools are in use", options_.max_requests));
  }
  const int pool = free_.back();
  free_.pop_back();
  in_use_[static_cast<size_t>(pool)] = true;
  return pool;
}

Status DeviceCompactPools::Release(int pool) {
  if (pool < 0 || pool >= options_.max_requests || !in_use_[static_cast<size_t>(pool)]) {
    return InvalidArgumentError(fmt::format("device compact pools: pool {} is not in use", pool));
  }
  in_use_[static_cast<size_t>(pool)] = false;
  free_.push_back(pool);
  return Status::Ok();
}

size_t DeviceCompactPools::LayerRows(int layer) const {
  const DeviceCompactPoolsOptions& o = options_;
  return static_cast<size_t>(layer) * o.max_requests * o.num_kv_heads *
         static_cast<size_t>(o.capacity) * o.head_dim;
}

const int32_t* DeviceCompactPools::layer_counts(int layer) const {
  return counts_.data() +
         static_cast<size_t>(layer) * options_.max_requests * options_.num_kv_heads;
}

const int32_t* DeviceCompactPools::layer_positions(int layer) const {
  return positions_.data() + static_cast<size_t>(layer) * options_.max_requests *
                                 options_.num_kv_heads * static_cast<size_t>(options_.capacity);
}

uint64_t DeviceCompactPools::device_bytes() const {
  return keys_.bytes() + values_.bytes() + counts_.bytes() + positions_.bytes();
}

Status DeviceCompactPools::Apply(int layer, const DeviceDeltaPack& pack, const int32_t* pool_index,
                                 cudaStream_t stream) {
  const DeviceCompactPoolsOptions& o = options_;
  if (layer < 0 || layer >= o.num_layers) {
    return InvalidArgumentError(
        fmt::format("device compact pools: layer {} outside [0, {})", layer, o.num_layers));
  }
  const size_t rows = LayerRows(layer);
  cuda::CompactDeltaScatterParams p;
  p.counts = pack.counts;
  p.slots = pack.slots;
  p.positions = pack.positions;
  p.keys = pack.keys;
  p.values = pack.values;
  p.rows = pack.rows;
  p.batch = pack.batch;
  p.num_kv_heads = o.num_kv_heads;
  p.head_dim = o.head_dim;
  p.pool_index = pool_index;
  p.num_pools = o.max_requests;
  p.capacity = o.capacity;
  p.pool_keys = keys_.data() + rows;
  p.pool_values = values_.data() + rows;
  p.pool_counts = counts_.data() + static_cast<size_t>(layer) * o.max_requests * o.num_kv_heads;
  p.pool_positions = positions_.data() + rows / static_cast<size_t>(o.head_dim);
  return cuda::ScatterCompactDelta(p, stream);
}

void DeviceCompactPools::SetCompactSegment(int layer, const int32_t* pool_index,
                                           cuda::DecodeAttentionParams& params) const {
  params.compact_keys = layer_keys(layer);
  params.compact_values = layer_values(layer);
  params.compact_capacity = options_.capacity;
  params.compact_counts = layer_counts(layer);
  params.compact_slots = pool_index;
  params.num_compact_slots = options_.max_requests;
}

}  // namespace rubato
