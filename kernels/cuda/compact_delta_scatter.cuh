// Compact delta scatter on the GPU: the inference rank's half of delta replies. Each (sequence,
// KV head) keeps a persistent compact pool of its selected rows (in slot order, not position
// order); a delta pack carries the rows entering the selection with the slots they take
// (compact_slot_update.cuh on the cache rank), and this op writes them into their slots, sets
// the rows in use to the delta's count and marks the slots past it empty. The pool is then what
// two-segment decode attention reads as its compact segment (decode_attention.cuh compact_keys
// with compact_slots = pool_index). CPU twin: transport/compact_delta.h CompactPool::Apply (f32;
// the rows here are copied bit for bit). Never synchronizes; graph-capturable (the grid depends
// on batch, heads, rows and head_dim only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct CompactDeltaScatterParams {
  // The delta pack, device: per (sequence b, KV head h) the pool's rows in use after the delta
  // ([batch][num_kv_heads]), and `rows` entering-row entries ([batch][num_kv_heads][rows]): the
  // slot each takes (-1 past the entering rows: skipped), its position, and its K / V row
  // ([batch][num_kv_heads][rows][head_dim], bf16, 16-byte aligned).
  const int32_t* counts = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* positions = nullptr;
  const __nv_bfloat16* keys = nullptr;
  const __nv_bfloat16* values = nullptr;
  int rows = 0;   // >= 0
  int batch = 0;  // >= 0; 0 is a no-op
  int num_kv_heads = 0;
  int head_dim = 0;  // a multiple of 8
  // The pools, device: sequence b writes pool pool_index[b] (outside [0, num_pools): nothing).
  const int32_t* pool_index = nullptr;   // [batch]
  int num_pools = 0;                     // >= 1
  int capacity = 0;                      // slots per (pool, KV head), >= 1
  __nv_bfloat16* pool_keys = nullptr;    // [num_pools][num_kv_heads][capacity][head_dim]
  __nv_bfloat16* pool_values = nullptr;  // same
  int32_t* pool_counts = nullptr;        // [num_pools][num_kv_heads]: the delta's count
  int32_t* pool_positions = nullptr;     // [num_pools][num_kv_heads][capacity], -1 empty
};

// A count is clamped to [0, capacity]; an entering row whose slot is not below it (a caller or
// peer bug; CompactPool::Apply refuses it) is skipped. Not checked on the device: that the
// entering rows fill every slot below the count not in use before (the cache rank's slot map
// guarantees it).
Status ScatterCompactDelta(const CompactDeltaScatterParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
