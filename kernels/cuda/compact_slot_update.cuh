// Compact slot update on the GPU: the cache rank's half of delta replies. For each (sequence, KV
// head), the slot map of the peer's persistent compact pool is turned into the new selection's
// (sink rows then the selected positions, what pooled top-k gives compact gather), and the delta
// written: the count after it and the entering rows with the slots they take, by the rule of
// kernels/cpu/compact_slot_update.h (its CPU twin, checked element by element; the same rule as
// transport/compact_delta.h CompactSlotMap::Update). The entering rows' K / V are then gathered
// by compact gather (compact_gather.cuh) with the entering positions as its selection. One block
// per (sequence, KV head); no host synchronization; graph-capturable (the grid depends on batch
// and heads only).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct CompactSlotUpdateParams {
  // [num_maps][num_kv_heads][1 + capacity], int32, device, updated in place: element 0 the slots
  // in use, element 1 + s the position in slot s.
  int32_t* maps = nullptr;
  int num_maps = 0;
  const int32_t* map_index = nullptr;  // [batch], device: the map sequence b updates
  const int32_t* reset = nullptr;      // optional [batch], device: nonzero, the map counts empty
  // The new selection of (b, h): positions 0..sink_end[b]-1 (clamped to [0, max_sink_tokens]),
  // then selected[(b * num_kv_heads + h) * budget + i] for i < selected_count[b * num_kv_heads
  // + h] (clamped to [0, budget]); strictly ascending (not checked on the device).
  const int32_t* sink_end = nullptr;  // [batch], device
  int max_sink_tokens = 0;
  const int32_t* selected = nullptr;        // [batch][num_kv_heads][budget], device
  const int32_t* selected_count = nullptr;  // [batch][num_kv_heads], device
  int budget = 0;
  int batch = 0;  // >= 0; 0 is a no-op
  int num_kv_heads = 0;
  int capacity = 0;  // slots per map, >= max_sink_tokens + budget, <= kMaxCompactSlots
  // Device outputs: [batch][num_kv_heads] the count after the delta and the entering rows;
  // [batch][num_kv_heads][capacity] their slots and positions, -1 past them.
  int32_t* counts = nullptr;
  int32_t* entering = nullptr;
  int32_t* entering_slots = nullptr;
  int32_t* entering_positions = nullptr;
};

// The largest map: its flags and free-slot list live in shared memory (6 bytes a slot).
inline constexpr int kMaxCompactSlots = 8000;

// A sequence whose map_index is outside [0, num_maps) (a caller bug) writes nothing. Never
// synchronizes.
Status CompactSlotUpdate(const CompactSlotUpdateParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
