// Compact slot update: the cache rank's half of delta replies (transport/compact_delta.h), batched
// over the layout the GPU keeps. Each (sequence, KV head) has a slot map of its peer's persistent
// compact pool; given the new selection (sink rows then the selected positions, as compact gather
// takes them) the map is turned into the new selection's and the delta written: the count after
// it and the rows entering, each with the slot it takes. The rule is CompactSlotMap::Update's,
// stated so that every row can be placed independently: a row of an old slot below the new count
// that is selected again stays; the entering rows (the other selected ones, ascending by
// position) take the free slots below the new count (ascending), the i-th entering row the i-th
// free slot. A reset (the peer's pool is empty) counts the old map as empty. Contract of the CUDA
// twin too (kernels/cuda/compact_slot_update.cuh), which is checked against this one element by
// element. Narrative: docs/disaggregated.md "Delta replies on the GPU cache rank".
#pragma once

#include <cstdint>

#include "common/status.h"

namespace rubato {

struct CompactSlotUpdateArgs {
  // [num_maps][num_kv_heads][1 + capacity], int32: element 0 the slots in use (count), element
  // 1 + s the position in slot s (entries at or past the count unspecified). Updated in place.
  int32_t* maps = nullptr;
  int num_maps = 0;
  const int32_t* map_index = nullptr;  // [batch]: the map sequence b updates
  const int32_t* reset = nullptr;      // optional [batch]: nonzero, the map counts as empty
  // The new selection of (b, h): positions 0..sink_end[b]-1 (sink_end clamped to [0,
  // max_sink_tokens]), then selected[(b * num_kv_heads + h) * budget + i] for i <
  // selected_count[b * num_kv_heads + h] (clamped to [0, budget]), together strictly ascending.
  const int32_t* sink_end = nullptr;  // [batch]
  int max_sink_tokens = 0;
  const int32_t* selected = nullptr;        // [batch][num_kv_heads][budget]
  const int32_t* selected_count = nullptr;  // [batch][num_kv_heads]
  int budget = 0;
  int batch = 0;
  int num_kv_heads = 0;
  int capacity = 0;  // slots per map, >= max_sink_tokens + budget
  // Outputs, [batch][num_kv_heads] and [batch][num_kv_heads][capacity]: the count after the
  // delta, the entering rows, and their slots and positions (entering order), -1 past them.
  int32_t* counts = nullptr;
  int32_t* entering = nullptr;
  int32_t* entering_slots = nullptr;
  int32_t* entering_positions = nullptr;
};

// InvalidArgument, naming the field, for a bad shape, a missing pointer, a map_index outside
// [0, num_maps) or a selection that is not strictly ascending; nothing is written then. (The
// CUDA twin checks the shapes only: a sequence with a bad map_index writes nothing, and a
// selection out of order gives an unspecified delta.)
Status CompactSlotUpdate(const CompactSlotUpdateArgs& args);

}  // namespace rubato
