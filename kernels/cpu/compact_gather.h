// Compact gather: copies the K and V of the positions a sparse policy keeps (sink then selected,
// per KV head) out of one sequence's paged KV cache into rows 0..count-1 of that head's compact
// buffer, which two-segment attention reads as its first segment. Contract (the CUDA twin's
// too): row i of head h is bit for bit position positions[h][i]; counts[h] =
// positions[h].size(); rows past the count are left as they were; a rejected call writes
// nothing. Narrative: docs/kernels_cpu.md "Compact gather".
#pragma once

#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/cpu/compact_kv_view.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

// kv:         the sequence's K/V of one layer; its block table covers positions [0, num_tokens).
// num_tokens: how many positions the sequence holds (>= 0).
// positions:  [kv.num_kv_heads] lists; positions[h] holds the positions head h keeps, strictly
//             ascending, each in [0, num_tokens), at most compact.capacity of them.
// compact:    destination; num_kv_heads and head_dim equal kv's.
// counts:     [kv.num_kv_heads] out: counts[h] = positions[h].size().
// InvalidArgument, naming the head and the position, on a shape mismatch, a missing pointer,
// more positions than the capacity, a position outside [0, num_tokens) or out of order
// (including a repeated position).
Status GatherCompactKv(const PagedKvView& kv, int num_tokens,
                       std::span<const std::vector<int>> positions, const CompactKvView& compact,
                       std::span<int> counts);

}  // namespace rubato
