// Compact gather on the GPU (docs/design.md §4.2 "Reorganization"): for each (sequence, KV head),
// the sink positions and then the selected positions are copied, K and V, out of the paged pools
// into rows 0.. of that head's compact buffer, which two-segment decode attention reads as its
// first segment (decode_attention.cuh). CPU twin: kernels/cpu/compact_gather.h (one sequence,
// f32); given the same positions both produce the same rows bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct CompactGatherParams {
  const __nv_bfloat16* key_pool = nullptr;    // [blocks][num_kv_heads][block_tokens][head_dim]
  const __nv_bfloat16* value_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
  int64_t num_pool_blocks = 0;                // blocks in each pool, >= 1
  const int32_t* block_tables = nullptr;      // [batch][block_table_stride] physical block ids
  int block_table_stride = 0;
  // [batch], device: rows 0..sink_end[b]-1 of every head of sequence b are positions
  // 0..sink_end[b]-1 (clamped to [0, max_sink_tokens]).
  const int32_t* sink_end = nullptr;
  int max_sink_tokens = 0;  // host bound of sink_end, >= 0
  // [batch][num_kv_heads][budget], device: positions (a selection's `selected`); the first
  // selected_count[b][h] (clamped to [0, budget]) follow the sink rows.
  const int32_t* selected = nullptr;
  const int32_t* selected_count = nullptr;  // [batch][num_kv_heads], device
  int budget = 0;                           // row stride of `selected`, >= 0
  int batch = 0;                            // >= 0; 0 is a no-op
  int num_kv_heads = 0;
  int head_dim = 0;                         // a multiple of 8 (16-byte rows)
  int block_tokens = 0;                     // >= 1
  __nv_bfloat16* compact_keys = nullptr;    // [batch][num_kv_heads][capacity][head_dim]
  __nv_bfloat16* compact_values = nullptr;  // [batch][num_kv_heads][capacity][head_dim]
  int compact_capacity = 0;                 // >= max_sink_tokens + budget
  // [batch][num_kv_heads], device out: sink_end[b] + selected_count[b][h] (both clamped).
  int32_t* compact_counts = nullptr;
  // Optional out: [batch][num_kv_heads][compact_capacity], device: the position each written
  // row was copied from (the CPU twin's `kept` lists); rows [count, capacity) left as they were.
  int32_t* compact_positions = nullptr;
  // Optional: [batch], device: sequence b writes the buffers of slot compact_slots[b] instead of
  // those of index b; compact_keys / compact_values / compact_counts / compact_positions then
  // hold num_compact_slots slots in place of the batch dimension (a pool of per-request compact
  // buffers, decode_attention.cuh compact_slots). A slot outside [0, num_compact_slots) (a
  // caller bug) writes nothing.
  const int32_t* compact_slots = nullptr;
  int num_compact_slots = 0;  // >= 1 when compact_slots is set
};

// Rows [count, capacity) are left as they were. Positions live on the device and are not
// checked here; a position outside [0, block_table_stride * block_tokens) or a block id outside
// [0, num_pool_blocks) (a caller bug) gives a row of NaN instead of a read out of bounds. The
// pools and compact buffers must be 16-byte aligned. Never synchronizes; batch == 0 is a no-op.
Status GatherCompactKv(const CompactGatherParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
