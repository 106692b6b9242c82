// Two-segment sparse decode attention: one query token of one sequence attends, per KV head, the
// working set sink ∪ selected ∪ recent in two segments, the compact rows [0, compact_counts[h])
// (compact_gather.h) and the paged positions [recent_begin, recent_end) read in place, under one
// fp32 softmax (the CUDA twin's contract, to fp32 rounding). Each position must appear once; lse
// is a natural log; an empty working set gives output 0 and lse −inf, never NaN.
// Narrative (numerics, dense as a special case): docs/kernels_cpu.md "Two-segment sparse decode
// attention".
#pragma once

#include <span>

#include "common/status.h"
#include "kernels/cpu/compact_kv_view.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct TwoSegmentAttentionArgs {
  const float* query = nullptr;  // [num_heads][head_dim], f32 (after RoPE)
  float* output = nullptr;       // [num_heads][head_dim], f32; must not overlap query
  float* lse = nullptr;          // optional [num_heads], f32, natural log; nullptr: not written
  int num_heads = 0;             // query heads; a multiple of kv.num_kv_heads
  CompactKvView compact;         // segment 1; num_kv_heads and head_dim equal kv's
  const int* compact_counts = nullptr;  // [num_kv_heads]: valid rows per head, in [0, capacity]
  PagedKvView kv;                       // segment 2 source; block table covers [0, recent_end)
  int recent_begin = 0;                 // segment 2 = positions [recent_begin, recent_end),
  int recent_end = 0;                   // 0 <= recent_begin <= recent_end; may be empty
};

// OK when the shapes agree (num_heads a positive multiple of num_kv_heads, compact and kv of the
// same num_kv_heads and head_dim, every count in [0, capacity], 0 <= recent_begin <= recent_end,
// scratch size representable) and every pointer that will be read or written is set. The block
// table's length is not known to the view and cannot be checked. InvalidArgument otherwise,
// naming the field. TwoSegmentAttentionForKvHead does not check again.
Status ValidateTwoSegmentAttention(const TwoSegmentAttentionArgs& args);

// Scratch floats one call of TwoSegmentAttentionForKvHead needs: the scores of one query row,
// compact.capacity + (recent_end - recent_begin). Independent of the counts, so one allocation
// serves every step with the same capacity and recent window. Meaningful for validated args.
int TwoSegmentAttentionScratchSize(const TwoSegmentAttentionArgs& args);

// The output (and lse) of the query heads that read KV head `kv_head` (the GQA group). Groups
// write disjoint outputs, so different kv_heads may run on different threads. `args` must have
// passed ValidateTwoSegmentAttention and kv_head be in [0, kv.num_kv_heads).
//   scratch: [TwoSegmentAttentionScratchSize(args)], f32, owned by the calling thread
void TwoSegmentAttentionForKvHead(const TwoSegmentAttentionArgs& args, int kv_head, float* scratch);

// Validates `args` and the scratch size, then runs every KV head, one after the other.
//   scratch: [>= TwoSegmentAttentionScratchSize(args)], f32
Status TwoSegmentAttention(const TwoSegmentAttentionArgs& args, std::span<float> scratch);

}  // namespace rubato
