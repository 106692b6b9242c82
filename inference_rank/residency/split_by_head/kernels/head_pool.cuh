// The device compact pool of the split_by_head residency (docs/synckv.md "On the GPU"): per
// (request slot, layer) the NR-heads' rows of their cluster's static and dynamic sets,
// [slot][kv_head][pool_capacity][head_dim], attended by the two-segment decode attention
// (kernels/cuda/decode_attention.cuh compact_slots) before the recent positions read in place.
// All NR-heads of a cluster hold the same positions in the same pool rows, so the bookkeeping
// is per (slot, cluster): which position each pool row holds and which pool row each position
// is in. Two ops, one (row, cluster) block each:
//   * HeadPoolUpdate: the bookkeeping of a new selection. Install (the prompt's end): the
//     static set in rows [0, S), the dynamic set after it. Anticipation: the rows of the old
//     dynamic set not selected again are freed, the selected positions not yet in the pool
//     (the delta) take the freed rows, then rows past the old end; kept rows stay where they
//     are. It lists the moves (pool row <- position) and sets the attended counts.
//   * HeadPoolCopy: the moves' K/V rows for every NR-head of the cluster, from the paged pool
//     (positions >= local_from: the recent positions, still local) or from the offloaded store
//     (the fetch: pinned host memory mapped into the device's address space, or another GPU's
//     memory with peer access), one launch for each source so that the fetch can run on a copy
//     stream.
// CPU twin: head_pool_cpu.h, the same contract on host arrays (bit-exact: integer bookkeeping
// and row copies).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

// One layer's bookkeeping (the caller offsets every array to its layer).
struct HeadPoolBook {
  int32_t* positions = nullptr;  // [slots][clusters][pool_capacity]: the position of each row
  int32_t* row_of = nullptr;     // [slots][clusters][context_capacity]: a position's row, or -1
  int32_t* sizes = nullptr;      // [slots][clusters][2]: static rows S, dynamic rows D
  int32_t* counts = nullptr;     // [slots][kv_heads]: S + D for the cluster's NR-heads
  const int32_t* cluster_of = nullptr;  // [kv_heads], device: a NR-head's cluster, -1 R-heads
  int slots = 0;
  int clusters = 0;
  int kv_heads = 0;
  int pool_capacity = 0;     // rows per (slot, kv_head), >= 1
  int context_capacity = 0;  // positions per slot, >= 1
};

struct HeadPoolUpdateParams {
  HeadPoolBook book;
  bool install = false;           // the prompt's end (else an anticipation)
  int rows = 0;                   // >= 0; 0 is a no-op
  const int32_t* slot = nullptr;  // [rows], device: each row's pool slot
  // [rows][clusters][selected_stride], device, ascending positions: the new dynamic set
  // (selected_count[rows][clusters] of them).
  const int32_t* selected = nullptr;
  const int32_t* selected_count = nullptr;
  int selected_stride = 0;
  // Install only, same layout: the static set.
  const int32_t* static_selected = nullptr;
  const int32_t* static_count = nullptr;
  // [rows][clusters][pool_capacity], device scratch: the freed rows.
  int32_t* scratch = nullptr;
  // [rows][clusters][pool_capacity], device out: move i writes pool row move_rows[i] with
  // position move_positions[i], for i < move_count[rows][clusters].
  int32_t* move_rows = nullptr;
  int32_t* move_positions = nullptr;
  int32_t* move_count = nullptr;
};

// An anticipation's selected count must not fall below the old dynamic count (SyncKV's budget
// grows with the context); where it does, only as many old rows are freed as new positions
// arrive (the others stay attended). Positions outside [0, context_capacity) are skipped.
Status HeadPoolUpdate(const HeadPoolUpdateParams& params, cudaStream_t stream);

enum class HeadPoolSource { kLocal, kStore };

struct HeadPoolCopyParams {
  int rows = 0;
  int clusters = 0;
  int kv_heads = 0;
  int head_dim = 0;                      // a multiple of 8
  const int32_t* cluster_of = nullptr;   // [kv_heads], device: -1 for R-heads
  const int32_t* store_index = nullptr;  // [kv_heads], device: a NR-head's index in the store
  const int32_t* slot = nullptr;         // [rows], device
  const int32_t* move_rows = nullptr;    // HeadPoolUpdateParams' moves
  const int32_t* move_positions = nullptr;
  const int32_t* move_count = nullptr;
  int move_stride = 0;  // = pool_capacity
  // Moves of positions >= local_from[r] are kLocal (the paged pool), the others kStore.
  const int32_t* local_from = nullptr;  // [rows], device
  HeadPoolSource source = HeadPoolSource::kLocal;
  // kLocal: the layer's paged pools [blocks][kv_heads][block_tokens][head_dim] and row r's
  // block table at block_tables + table_index[r] * block_table_stride.
  const __nv_bfloat16* key_pool = nullptr;
  const __nv_bfloat16* value_pool = nullptr;
  const int32_t* block_tables = nullptr;
  const int32_t* table_index = nullptr;
  int block_table_stride = 0;
  int block_tokens = 0;
  // kStore: the layer's store, row (slot * context_capacity + position) of NR index i at
  // store_keys + (i * store_rows + row) * head_dim (device-addressable: mapped pinned host
  // memory or a peer GPU's memory).
  const __nv_bfloat16* store_keys = nullptr;
  const __nv_bfloat16* store_values = nullptr;
  int64_t store_rows = 0;  // slots * context_capacity
  int context_capacity = 0;
  // The layer's pools [slots][kv_heads][pool_capacity][head_dim].
  __nv_bfloat16* pool_keys = nullptr;
  __nv_bfloat16* pool_values = nullptr;
  int pool_capacity = 0;
  // Optional: adds the rows this launch copied (summed over heads).
  unsigned long long* copied_rows = nullptr;
  // Tests: each block sleeps this long before it copies (a late fetch; the blocks sleep at once).
  unsigned int delay_ns = 0;
};

Status HeadPoolCopy(const HeadPoolCopyParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
