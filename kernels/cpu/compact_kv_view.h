// How CPU ops see one (request, layer)'s compact KV buffer (docs/design.md §3 "Working set"): the
// sink and selected keys and values of a sparse policy, gathered out of the paged cache into one
// contiguous slab per KV head. Row r of KV head h is the r-th kept position of that head (sink
// then selected, ascending); how many rows are valid is per-head state kept next to the buffer
// (the counts GatherCompactKv writes), not part of the view. Like PagedKvView this is a
// non-owning view: copying it copies pointers, never K/V.
#pragma once

#include <cstddef>

namespace rubato {

struct CompactKvView {
  float* keys = nullptr;    // [num_kv_heads][capacity][head_dim], f32
  float* values = nullptr;  // [num_kv_heads][capacity][head_dim], f32
  int num_kv_heads = 0;
  int capacity = 0;  // rows per KV head; a head's count of valid rows is in [0, capacity]
  int head_dim = 0;

  // Offset, in floats, of the [head_dim] vector at `row` of `kv_head`'s slab; rows of one head
  // are contiguous, so keys + Offset(h, r) is [capacity - r][head_dim].
  size_t Offset(int kv_head, int row) const {
    return (static_cast<size_t>(kv_head) * capacity + row) * head_dim;
  }
};

}  // namespace rubato
