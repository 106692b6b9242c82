// SnapKV-style prompt scoring (Li et al. 2024; used by the LongFlow paper §4.1 to compress a
// prompt longer than the KV budget), CPU reference. Per KV head: each of the prompt's last
// `window` queries takes its causal softmax over positions [0, its own]; the weights on the
// prefix [0, length - window) are summed over the window and over the GQA group's query heads,
// then max-pooled along positions (kernel `pool_kernel`, odd, centred, clipped at the ends:
// SnapKV's max_pool1d with padding kernel / 2). SnapKvKeep then keeps the sinks, the top of the
// pooled scores and the window. Narrative and defaults: docs/longflow.md.
#pragma once

#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct SnapKvScoreArgs {
  // [window][num_heads][head_dim], f32, after RoPE: the queries of positions
  // [length - window, length), in position order.
  const float* window_queries = nullptr;
  int window = 0;  // >= 1, < length
  int num_heads = 0;
  PagedKvView kv;  // the layer's keys of positions [0, length)
  int length = 0;
  int pool_kernel = 1;      // odd, >= 1
  float* scores = nullptr;  // [num_kv_heads][length - window] out: pooled, >= 0
};

// OK when the shapes agree and the pointers are set; InvalidArgument naming the field otherwise.
Status ValidateSnapKvScores(const SnapKvScoreArgs& args);

// Floats of scratch one SnapKvScoresForKvHead call needs: length + (length - window).
int SnapKvScoresScratchSize(const SnapKvScoreArgs& args);

// The pooled scores of KV head `kv_head`; heads may run on different threads. `args` must have
// passed validation; scratch is the calling thread's.
void SnapKvScoresForKvHead(const SnapKvScoreArgs& args, int kv_head, float* scratch);

Status SnapKvScores(const SnapKvScoreArgs& args, std::span<float> scratch);

// The positions one KV head keeps, ascending: [0, sink_tokens), the `budget - sink_tokens -
// window` prefix positions in [sink_tokens, length - window) of highest score (ties to the lower
// position), and the window [length - window, length). scores: [length - window] of that head.
// Needs sink_tokens + window < budget < length.
void SnapKvKeep(const float* scores, int length, int window, int sink_tokens, int budget,
                std::vector<int>& kept);

}  // namespace rubato
