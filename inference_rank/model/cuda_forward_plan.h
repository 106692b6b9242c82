// Host-side planning of one CUDA forward: where every entry's tokens sit in the batch rows, and
// the packed step inputs that one host-to-device copy delivers to the kernels.
//
// Row order. Decode entries (one token) come first, then prefill chunks in batch order:
// decode attention runs over rows [0, decode_rows) and prefill attention over the rest, each
// once per layer, and a batch of decode entries only is the shape a CUDA graph replays. Decode
// rows are themselves [SFI fast | SFI slow | dense], each group in batch order, so that each
// kind of attention is one launch per layer (cuda_model_sfi.cc): two-segment attention over
// the fast rows, dense attention that also writes the Selector's scores over the slow rows,
// plain dense attention over the rest.
//
// SFI selections. Every slow SFI entry refreshes its selection: the slow decode rows (W = 1),
// then the SFI prefill chunks (W = window_queries, their "window rows": the chunk's last W
// query rows, attended again over all the chunk's keys to get their scores) in batch order.
//
// Logit rows. The lm_head runs only on the rows whose logits someone needs, gathered in this
// order:
//   [0, sample_rows)                 the last row of every entry with sampling, in batch order
//                                    (SampleTokens reads them as one contiguous block);
//   [sample_rows, + host_rows)       the rows copied back to the host, in batch order: every
//                                    row of a kAll entry, the last row of a kLast entry without
//                                    sampling. A kLast entry with sampling leaves its logits on
//                                    the device (Model::Forward allows it): a decode step
//                                    returns token ids, not [batch][vocab] floats.
// A kAll entry with sampling has its last row in both blocks (one extra lm_head row).
//
// Step inputs. Every per-forward array the kernels read (token ids, positions, KV slots, block
// tables, sequence lengths, query starts, logit row indices, sampling rows, SFI slots and
// segment bounds: the paper's "packed descriptor", §4.2) lives in one buffer
// whose layout depends only on its capacity, not on this batch's sizes. The host fills a pinned
// copy, one cudaMemcpyAsync moves it, and a captured CUDA graph keeps reading the same device
// addresses step after step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/model/model.h"
#include "kernels/cuda/sampling.cuh"

namespace rubato {

// How many elements each step-input array can hold. Grows (never shrinks) as batches need.
struct StepInputCapacity {
  int tokens = 0;              // token ids, positions, KV slots
  int decode_rows = 0;         // decode sequence lengths
  int decode_table_ints = 0;   // [decode rows][decode stride] block ids
  int prefill_entries = 0;     // start positions (+1 for query starts)
  int prefill_table_ints = 0;  // [prefill entries][prefill stride] block ids
  int logit_rows = 0;          // gather indices
  int sample_rows = 0;         // SamplingRow
  int sfi_fast_rows = 0;       // fast rows' slots and recent_begin
  int sfi_selections = 0;      // selections' slots, sink ends and |J|
  int sfi_window_rows = 0;     // window rows' lengths and query rows
  int sfi_window_table_ints = 0;  // [window rows][prefill stride] block ids

  bool Covers(const StepInputCapacity& need) const;
  // Each field the larger of the two, rounded up to a power of two (few reallocations while a
  // server warms up).
  StepInputCapacity GrownToCover(const StepInputCapacity& need) const;
};

// Byte offsets of the arrays in the step-input buffer (host staging and device copy alike), all
// 16-byte aligned.
struct StepInputLayout {
  size_t sampling_rows = 0;            // [sample rows] cuda::SamplingRow
  size_t token_ids = 0;                // [tokens] int32
  size_t positions = 0;                // [tokens] int32
  size_t kv_slots = 0;                 // [tokens] int32: block * block_tokens + row
  size_t decode_block_tables = 0;      // [decode rows][decode_table_stride] int32
  size_t decode_seq_lens = 0;          // [decode rows] int32: start_position + 1
  size_t prefill_block_tables = 0;     // [prefill entries][prefill_table_stride] int32
  size_t prefill_query_start = 0;      // [prefill entries + 1] int32, relative to the first
                                       // prefill row
  size_t prefill_start_positions = 0;  // [prefill entries] int32
  size_t logit_row_indices = 0;        // [sample rows + host rows] int32: batch rows to gather
  size_t sfi_fast_slots = 0;           // [fast rows] int32: compact-pool slot
  size_t sfi_recent_begin = 0;         // [fast rows] int32: the state's anchor
  size_t sfi_slow_slots = 0;           // [selections] int32: compact-pool slot
  size_t sfi_sink_end = 0;             // [selections] int32: SfiSinkEnd = J's first position
  size_t sfi_j_count = 0;              // [selections] int32: |J| = SfiAnchor - SfiSinkEnd
  size_t sfi_window_seq_lens = 0;      // [window rows] int32: the chunk's end (all its keys)
  size_t sfi_window_q_rows = 0;        // [window rows] int32: batch row of the query
  size_t sfi_window_block_tables = 0;  // [window rows][prefill_table_stride] int32
  size_t bytes = 0;                    // the whole buffer

  static StepInputLayout For(const StepInputCapacity& capacity);
};

// An SFI prefill chunk's selection (see the file comment).
struct SfiWindowPlan {
  int entry = 0;          // batch index
  int prefill_index = 0;  // among the prefill chunks (its prefill block-table row)
  int window = 0;         // W: the chunk's last W rows are its window rows
  int first_row = 0;      // its first window row
  int length = 0;         // keys after the chunk: start_position + tokens
  int j_count = 0;        // |J| at that length
};

// One forward, planned.
struct ForwardPlan {
  int tokens = 0;              // all rows
  int decode_rows = 0;         // one-token entries, rows [0, decode_rows)
  int prefill_entries = 0;     // chunks, rows [decode_rows, tokens)
  int max_prefill_tokens = 0;  // largest chunk
  // Decode attention's max_seq_len: a bucket (DecodeSeqLenBucket) holding every decode entry's
  // keys, so that the launch shape, and a graph captured for it, stay the same while sequences
  // grow. Eager forwards use the same bucket, so graph and eager compute the same bits.
  int decode_max_seq_len = 0;
  int decode_table_stride = 0;   // blocks per decode block-table row (covers the bucket)
  int prefill_table_stride = 0;  // blocks per prefill block-table row
  int sample_rows = 0;
  int host_rows = 0;
  std::vector<int> entry_first_row;   // [entries] row of the entry's first token
  std::vector<int> entry_sample_row;  // [entries] row in the sampled block, or -1
  std::vector<int> entry_host_row;    // [entries] first row in the host block (0 if none)
  std::vector<int> entry_host_rows;   // [entries] rows in the host block

  // SFI (see the file comment); all zero / empty for a batch without SFI entries.
  int sfi_fast_rows = 0;           // decode rows [0, sfi_fast_rows)
  int sfi_slow_rows = 0;           // decode rows [sfi_fast_rows, + sfi_slow_rows): selections 0..
  int sfi_selections = 0;          // sfi_slow_rows + sfi_windows.size()
  int sfi_window_rows = 0;         // sum of the windows
  int sfi_window_max_seq_len = 0;  // longest window row's keys (max SfiWindowPlan::length)
  // Bound of L - anchor over the fast rows (the two-segment grid): recent_window + t_max, what
  // the engine's schedule allows, or the power of two above a longer segment; at most the decode
  // bucket.
  int sfi_recent_bucket = 0;
  // SfiSelect bound of |J| over the slow decode rows: max(0, decode bucket - recent_window).
  int sfi_max_j_count = 0;
  int sfi_score_stride = 0;  // row stride of the scores: covers every selection's keys, x 64
  const SfiPolicyConfig* sfi_config = nullptr;  // the batch's SFI config (one per forward)
  std::vector<SfiWindowPlan> sfi_windows;       // the prefill selections, in batch order
  std::vector<int> entry_selection;  // [entries] selection index of a slow SFI entry, or -1
  int sfi_score_rows() const { return sfi_slow_rows + sfi_window_rows; }

  bool decode_only() const { return prefill_entries == 0; }
  int logit_rows() const { return sample_rows + host_rows; }
  StepInputCapacity Needs() const;
};

// The decode attention bucket for sequences of at most `max_len` keys in a cache of
// `cache_tokens` positions: 4096 up to 4096 keys, beyond that max_len rounded up to a multiple
// of max(1024, bit_floor(max_len) / 8), i.e. eight buckets per power of two. The attention grid
// is sized for the bucket, so an oversized bucket spreads the real keys over fewer blocks; this
// keeps the excess at 12.5 % from 8K keys on (25 % just above 4K), while a decoding batch keeps
// one bucket, and one graph, for at least 1024 steps. Never more than the cache holds (and
// never less than max_len).
int DecodeSeqLenBucket(int max_len, int cache_tokens);

// Plans `batch` (validated: SFI entries share one config) for a cache of `shape`. Reads
// positions and SFI states, not block tables.
void PlanForward(std::span<const ForwardEntry> batch, const KvCacheShape& shape, ForwardPlan& plan);

// Writes the step inputs of `plan` into `staging` (StepInputLayout::For(capacity) bytes, where
// capacity covers plan.Needs()). Every entry's block table must cover its new positions.
// sfi_slots: [entries] the compact-pool slot of each SFI entry (-1 for the others); may be empty
// when the batch has no SFI entry.
void FillStepInputs(std::span<const ForwardEntry> batch, const KvCacheShape& shape,
                    const ForwardPlan& plan, const StepInputLayout& layout, std::byte* staging,
                    std::span<const int> sfi_slots = {});

}  // namespace rubato
