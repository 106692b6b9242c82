// The CUDA model's KV pools: bf16 K and V on the device, behind PagedKvCache's KvStorage. The
// cache keeps the block accounting on the host (free list, block tables, all-or-nothing
// Reserve); the pools live here, laid out as docs/design.md §3 says:
//   keys, values: [layer][block][kv_head][block_tokens][head_dim], bf16
// so a block id names the same slot in every layer, and one layer's pool is a contiguous
// [block][kv_head][block_tokens][head_dim] array (what kernels/cuda/*attention* and kv_append
// take).
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <memory>

#include "common/status.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

class DeviceKvStorage : public KvStorage {
 public:
  // Allocates and zeroes both pools on the current device (zero: a block's unwritten rows hold
  // finite values, whatever the previous owner of the memory left there). ResourceExhausted
  // names the bytes asked for.
  static Result<std::unique_ptr<DeviceKvStorage>> Create(const KvCacheShape& shape);

  // Bytes of both pools for `shape`, bf16.
  static size_t PoolBytes(const KvCacheShape& shape);

  size_t bytes() const override { return keys_.bytes() + values_.bytes(); }
  const KvCacheShape& shape() const { return shape_; }

  // [block][kv_head][block_tokens][head_dim], bf16, of one layer.
  __nv_bfloat16* layer_keys(int layer) { return keys_.data() + layer_elements_ * layer; }
  __nv_bfloat16* layer_values(int layer) { return values_.data() + layer_elements_ * layer; }
  // Both whole pools: [layer][block][kv_head][block_tokens][head_dim], bf16.
  cuda::DeviceBuffer<__nv_bfloat16>& keys() { return keys_; }
  cuda::DeviceBuffer<__nv_bfloat16>& values() { return values_; }

 private:
  DeviceKvStorage() = default;

  KvCacheShape shape_;
  size_t layer_elements_ = 0;                 // blocks x kv_heads x block_tokens x head_dim
  cuda::DeviceBuffer<__nv_bfloat16> keys_;    // [layer][block][kv_head][block_tokens][head_dim]
  cuda::DeviceBuffer<__nv_bfloat16> values_;  // [layer][block][kv_head][block_tokens][head_dim]
};

}  // namespace rubato
