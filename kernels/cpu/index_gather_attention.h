// Index-gather sparse decode attention: one query token of one sequence attends, per KV head, the
// positions of a list (any order, each once) read in place from the paged KV through its block
// table, under one fp32 softmax; no copy into compact buffers. Same arithmetic as the dense
// rows path (Dot, softmax.h, values accumulated in list order), so the full ascending list
// reproduces dense decode bit for bit. The CUDA twin's contract, to fp32 rounding.
// Narrative: docs/kernels_cpu.md "Index-gather sparse decode attention".
#pragma once

#include <span>

#include "common/status.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct IndexGatherAttentionArgs {
  const float* query = nullptr;           // [num_heads][head_dim], f32 (after RoPE)
  float* output = nullptr;                // [num_heads][head_dim], f32; must not overlap query
  float* lse = nullptr;                   // optional [num_heads], natural log; nullptr: not written
  int num_heads = 0;                      // query heads; a multiple of kv.num_kv_heads
  PagedKvView kv;                         // block table covers [0, length)
  int length = 0;                         // positions lie in [0, length)
  const int* const* positions = nullptr;  // [num_kv_heads] lists of counts[h] positions
  const int* counts = nullptr;            // [num_kv_heads]
};

// OK when the shapes agree, every pointer that will be read or written is set and every list
// holds distinct positions in [0, length); InvalidArgument naming the field otherwise. An empty
// list is allowed (output 0, lse -inf). IndexGatherAttentionForKvHead does not check again.
Status ValidateIndexGatherAttention(const IndexGatherAttentionArgs& args);

// Scratch floats of one IndexGatherAttentionForKvHead call: the longest list.
int IndexGatherAttentionScratchSize(const IndexGatherAttentionArgs& args);

// The output (and lse) of the query heads of KV head `kv_head` (its GQA group); groups write
// disjoint outputs, so KV heads may run on different threads. `args` must have passed
// validation. scratch: [IndexGatherAttentionScratchSize(args)], f32, the calling thread's.
void IndexGatherAttentionForKvHead(const IndexGatherAttentionArgs& args, int kv_head,
                                   float* scratch);

// Validates, then runs every KV head in turn.
Status IndexGatherAttention(const IndexGatherAttentionArgs& args, std::span<float> scratch);

}  // namespace rubato
