// The inference rank's persistent compact pools on its GPU, the device half of delta replies
// (transport/compact_delta.h CompactPool is the host one): per (request, layer, KV head)
// `capacity` slots of bf16 K / V rows, in slot order, laid out as decode attention's pool of
// per-request compact buffers (decode_attention.cuh compact_slots), so that two-segment
// attention reads them in place:
//   keys, values: [layer][max_requests][num_kv_heads][capacity][head_dim], bf16
//   counts:       [layer][max_requests][num_kv_heads], int32: rows in use (slots [0, count))
//   positions:    [layer][max_requests][num_kv_heads][capacity], int32: -1 past the count
// A request takes a pool at admission and returns it at its end; each layer of a step scatters
// the cache rank's delta pack into the step's pools (kernels/cuda/compact_delta_scatter.cuh)
// and then attends them. Neither op synchronizes the host. Narrative: docs/disaggregated.md
// "Delta replies on the GPU cache rank".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

struct DeviceCompactPoolsOptions {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;      // a multiple of 8
  int capacity = 0;      // slots per (request, layer, KV head): sink + top_k of the policy
  int max_requests = 0;  // pools, >= 1
};

// One layer's delta pack on the device, the layout of DeviceDeltaOutputs
// (cache_rank/device/device_kv_store.h): per (entry b, KV head h) the count after the delta
// ([batch][num_kv_heads]) and `rows` entering rows' slots (-1 past them), positions and K / V
// ([batch][num_kv_heads][rows][head_dim] bf16).
struct DeviceDeltaPack {
  const int32_t* counts = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* positions = nullptr;
  const __nv_bfloat16* keys = nullptr;
  const __nv_bfloat16* values = nullptr;
  int rows = 0;
  int batch = 0;
};

class DeviceCompactPools {
 public:
  // Allocates every pool on the current device (counts zeroed).
  static Result<std::unique_ptr<DeviceCompactPools>> Create(const DeviceCompactPoolsOptions& o);

  // A free pool for a new request (its first delta must be a full reply: the cache rank's
  // fresh session gives one); kResourceExhausted naming max_requests when none is free.
  Result<int> Acquire();
  Status Release(int pool);

  // Writes `pack`'s entering rows of `layer` into the pools: entry b into pool pool_index[b]
  // (device, [pack.batch]).
  Status Apply(int layer, const DeviceDeltaPack& pack, const int32_t* pool_index,
               cudaStream_t stream);

  // Points `params`' compact segment at `layer`'s pools, row b reading pool pool_index[b]
  // (device, [params.batch]); the caller sets the recent segment (recent_begin,
  // max_recent_tokens) as local oracle_topk does.
  void SetCompactSegment(int layer, const int32_t* pool_index,
                         cuda::DecodeAttentionParams& params) const;

  const DeviceCompactPoolsOptions& options() const { return options_; }
  const __nv_bfloat16* layer_keys(int layer) const { return keys_.data() + LayerRows(layer); }
  const __nv_bfloat16* layer_values(int layer) const { return values_.data() + LayerRows(layer); }
  const int32_t* layer_counts(int layer) const;
  const int32_t* layer_positions(int layer) const;
  uint64_t device_bytes() const;

 private:
  DeviceCompactPools() = default;
  size_t LayerRows(int layer) const;  // elements before `layer`'s rows

  DeviceCompactPoolsOptions options_;
  cuda::DeviceBuffer<__nv_bfloat16> keys_;    // [layer][pool][kv_head][capacity][head_dim]
  cuda::DeviceBuffer<__nv_bfloat16> values_;  // same
  cuda::DeviceBuffer<int32_t> counts_;        // [layer][pool][kv_head]
  cuda::DeviceBuffer<int32_t> positions_;     // [layer][pool][kv_head][capacity]
  std::vector<int> free_;                     // free pools, the lowest last
  std::vector<bool> in_use_;                  // [max_requests]
};

}  // namespace rubato
