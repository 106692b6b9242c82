// Dense decode attention on the GPU: one new query token per sequence against its paged K/V
// (sink and recent window), split-K flash-decoding, GQA-aware; a second kernel merges the
// chunks' partial softmaxes. The grid depends only on batch, heads and max_seq_len, so the launch
// can be captured in a CUDA graph and replayed while sequences grow. CPU twin:
// kernels/cpu/attention.h (rows path) and attention_stats.h. docs/decode_attention.md "The op".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

// One plain struct for every launch; the optional fields below pick a compile-time variant of
// the split kernel in one place (decode_attention.cu LaunchVariant): a compact segment, raw
// scores (also behind the probabilities), or the window alone.
struct DecodeAttentionParams {
  // Query head h of sequence b at q + b * q_row_stride + h * head_dim, bf16 (after RoPE).
  const __nv_bfloat16* q = nullptr;
  int64_t q_row_stride = 0;
  const __nv_bfloat16* key_pool = nullptr;    // [blocks][num_kv_heads][block_tokens][head_dim]
  const __nv_bfloat16* value_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
  // Blocks in each pool. > 0 lets dense launches with head_dim 64 / 128 copy whole blocks
  // through tensor maps (the faster path, decode_attention_split.cuh), where a block id past the
  // pool reads zeros; 0: row copies, block ids trusted.
  int64_t num_pool_blocks = 0;
  const int32_t* block_tables = nullptr;  // [batch][block_table_stride] physical block ids
  int block_table_stride = 0;
  const int32_t* seq_lens = nullptr;  // [batch], device: keys held, 1 <= L <= max_seq_len
  int batch = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;      // 16, 32, 64, 128
  int block_tokens = 0;  // 16 or 64
  int max_seq_len = 0;   // upper bound of seq_lens; fixes the grid (graph-stable)
  float scale = 0.f;     // usually 1 / sqrt(head_dim)
  int sink_tokens = 0;
  int recent_tokens = INT_MAX;
  // Head h of sequence b written at out + b * out_row_stride + h * head_dim, bf16.
  __nv_bfloat16* out = nullptr;
  int64_t out_row_stride = 0;
  // Optional: [batch][num_heads], f32, natural-log sum of exp(scale * q.k) over attended keys.
  float* lse = nullptr;
  // Optional: [batch][num_kv_heads][probs_stride], f32: for each key position, the attention
  // probability averaged over the GQA group's query heads (0 where not attended); positions
  // [L, probs_stride) are left untouched. probs_stride >= max_seq_len.
  float* kv_head_probs = nullptr;
  int64_t probs_stride = 0;
  // Optional: [batch][num_heads][scores_stride], f32: the raw score of query head h of sequence
  // b for every key position p < L the window lets it attend, scale * q.k in LOG2 units (times
  // log2 e; a reader scales them by ln 2 for natural units). Positions the window hides and
  // [L, scores_stride) are left as they were. Dense launches only (no compact segment);
  // scores_stride >= max_seq_len. CPU twin: scale * Dot(q, k) (kernels/cpu/dot.h) * log2 e.
  float* scores = nullptr;
  int64_t scores_stride = 0;
  void* workspace = nullptr;  // DecodeAttentionWorkspaceBytes(...) bytes, device
  size_t workspace_bytes = 0;
  // Optional first segment (two-segment sparse attention, docs/design.md §3 "Working set"): per
  // (sequence b, KV head h), rows [0, compact_counts[b * num_kv_heads + h]) of
  //   compact_keys / compact_values + (b * num_kv_heads + h) * compact_capacity * head_dim
  // are attended first, then the paged positions [recent_begin[b], L) (not [0, L)). Needs a
  // dense window and no kv_head_probs. CPU twin: kernels/cpu/two_segment_attention.h.
  const __nv_bfloat16* compact_keys = nullptr;    // [batch][num_kv_heads][capacity][head_dim]
  const __nv_bfloat16* compact_values = nullptr;  // [batch][num_kv_heads][capacity][head_dim]
  int compact_capacity = 0;                       // rows per (sequence, KV head), >= 1
  const int32_t* compact_counts = nullptr;        // [batch][num_kv_heads], device, in [0, capacity]
  const int32_t* recent_begin = nullptr;          // [batch], device, in [0, L]
  int max_recent_tokens = 0;  // host bound of L - recent_begin over the batch (fixes the grid)
  // Optional with a compact segment: [batch], device: sequence b reads the compact rows and the
  // counts of slot compact_slots[b] (clamped to [0, num_compact_slots)) instead of those of index
  // b; compact_keys / compact_values are then [num_compact_slots][num_kv_heads][capacity]
  // [head_dim] and compact_counts [num_compact_slots][num_kv_heads]. A pool of per-request
  // compact buffers then serves any subset of its requests in any row order, with the slots a
  // step input (graph-replayable while requests come and go).
  const int32_t* compact_slots = nullptr;
  int num_compact_slots = 0;  // >= 1 when compact_slots is set
  // Optional index gather (a list of positions per KV head): with `lists` set, KV head h of
  // sequence b attends exactly the positions lists[(b * list_heads + m(h)) * list_capacity + i]
  // for i < list_counts[b * list_heads + m(h)] (clamped to [0, list_capacity]), in any order,
  // where m = list_head_map (device, [num_kv_heads], values in [0, list_heads)) or the identity
  // when null. seq_lens and the window are not read (max_seq_len only bounds the block tables);
  // positions must lie in the sequence's blocks and be distinct (not checked on the device). Row
  // copies; no compact segment, scores or probabilities. An empty list gives 0 and lse -inf.
  // CPU twin: kernels/cpu/index_gather_attention.h.
  const int32_t* lists = nullptr;
  const int32_t* list_counts = nullptr;
  int list_capacity = 0;  // >= 1 with lists: fixes the grid and the workspace
  int list_heads = 0;     // lists per sequence, >= 1 with lists
  const int32_t* list_head_map = nullptr;
  // Optional slot arrays (evicting KV residency): with slot_keys set, KV head h of sequence b
  // attends the valid rows of its slot array slot_keys / slot_values + (b * num_kv_heads + h) *
  // slot_budget * head_dim (rows i with slot_valid[b * slot_budget + i] != 0); key_pool,
  // value_pool, block_tables, seq_lens and the window are not read (max_seq_len = slot_budget).
  // Writes the raw scores of every slot to `scores` (scores_stride >= slot_budget; -inf where not
  // valid) and each attended slot's ||v||_1 to slot_value_norms [batch][num_kv_heads]
  // [slot_budget]. Tensor copies of whole tiles for head_dim 64 / 128 (rows past a slot array's
  // end and invalid rows zeroed in shared memory), else row copies; no compact segment, list or
  // probabilities.
  const __nv_bfloat16* slot_keys = nullptr;    // [batch][num_kv_heads][slot_budget][head_dim]
  const __nv_bfloat16* slot_values = nullptr;  // [batch][num_kv_heads][slot_budget][head_dim]
  const uint8_t* slot_valid = nullptr;         // [batch][slot_budget]
  int slot_budget = 0;
  float* slot_value_norms = nullptr;
  // Optional with slot arrays: [batch], device: sequence b reads the keys, values and validity of
  // array slot_arrays[b] (clamped to [0, num_slot_arrays)) instead of array b; slot_keys /
  // slot_values are then [num_slot_arrays][num_kv_heads][slot_budget][head_dim] and slot_valid
  // [num_slot_arrays][slot_budget]. The outputs (scores, norms) stay indexed by b. A pool of
  // per-request slot arrays then serves any subset of its requests in any row order.
  const int32_t* slot_arrays = nullptr;
  int num_slot_arrays = 0;  // >= 1 when slot_arrays is set
  // Optional with slot arrays: the eviction choice (kernels/cuda/slot_choice.cuh). slot_next
  // [arrays][num_kv_heads] (arrays: num_slot_arrays with slot_arrays, else batch) gets the slot
  // each (array, KV head)'s next token writes: the lowest invalid slot, else the valid slot of
  // least Eq. 6 score past the first slot_sink_slots, ties low, -1 when none. Optional:
  // slot_choice_scores [batch][num_kv_heads][slot_budget] (the scores, 0 where invalid) and
  // slot_used_max [batch][num_kv_heads] (1 where the largest score passes the plain-exponential
  // limit). Made in the split kernel when one split covers the slots, else after the merge.
  int32_t* slot_next = nullptr;
  int slot_sink_slots = 0;
  float* slot_choice_scores = nullptr;
  uint8_t* slot_used_max = nullptr;
  // Scores only: with `scores` set, the keys alone are read and only the raw scores are written,
  // plus `lse` when set (out and the probabilities untouched; value_pool and out may be null; the
  // workspace, DecodeScoresOnlyWorkspaceBytes, is needed only for the lse). A selection pass
  // whose layer's output comes from another launch (an index gather).
  bool scores_only = false;
  // Key splits per sequence: 0 chooses them from the shapes and the GPU's multiprocessor count
  // (ChooseSplits in decode_attention.cu); benchmarks set it to sweep. Capped at what the
  // workspace holds.
  int num_splits = 0;
};

// Device scratch a launch with these shapes needs (partial outputs and statistics per split,
// plus raw scores when probabilities are wanted).
size_t DecodeAttentionWorkspaceBytes(int batch, int num_heads, int head_dim, int max_seq_len,
                                     bool want_probs);

// Device scratch of a scores-only launch that also writes the lse (the splits' partial lse).
size_t DecodeScoresOnlyWorkspaceBytes(int batch, int num_heads, int max_seq_len);

// The key splits per sequence that a dense launch (no window, no compact segment, num_splits 0)
// of `batch` sequences bounded by `max_seq_len` keys chooses on the current device. A caller that
// attends the rows of one batch in several launches (some of them on another GPU of the same
// kind) passes it as num_splits to each, so that every row's output has the bits of one launch
// over the whole batch.
int DecodeAttentionDefaultSplits(int batch, int num_kv_heads, int max_seq_len);

Status DecodeAttention(const DecodeAttentionParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
