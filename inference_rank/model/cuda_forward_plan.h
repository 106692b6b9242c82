// Host-side planning of one CUDA forward: where every entry's tokens sit in the batch rows (decode
// rows by row group, then prefill chunks), which rows need logits, and the packed step inputs
// that one host-to-device copy delivers to the kernels, laid out by capacity so that a captured
// graph keeps reading the same addresses. docs/cuda_model.md has the row order, the logit rows
// and the step-input layout.
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
  int sample_rows = 0;         // SamplingRow (+1 logit-delta offsets)
  int logit_deltas = 0;        // LogitDelta
  size_t backend_bytes = 0;    // the attention backend's region (its StepInputBytes)

  bool Covers(const StepInputCapacity& need) const;
  // Each array count the larger of the two, rounded up to a power of two (few reallocations
  // while a server warms up); the backend's bytes the larger of the two (it rounds its own).
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
  size_t logit_delta_offsets = 0;      // [sample rows + 1] int32: CSR of the sampled rows'
                                       // logit deltas (written only when the plan adjusts)
  size_t logit_deltas = 0;             // [logit deltas] LogitDelta
  size_t backend = 0;                  // [backend bytes]: laid out by the attention backend
  size_t bytes = 0;                    // the whole buffer

  static StepInputLayout For(const StepInputCapacity& capacity);
};

// Consecutive decode rows of one row group (EntryAttention::row_group; 0: entries without an
// attention plan, the model's own dense rows and the residency's).
struct DecodeRowGroup {
  int group = 0;
  int first_row = 0;
  int rows = 0;
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
  // The attention backend's share: decode rows [0, backend_rows) (row groups >= 1) and the
  // prefill chunks with an attention plan, which come after those without one: prefill indices
  // [prefill_entries - backend_prefill_entries, prefill_entries).
  int backend_rows = 0;
  int backend_prefill_entries = 0;
  int backend_max_prefill_tokens = 0;  // largest chunk with a plan
  int plain_prefill_tokens = 0;        // rows of the chunks without a plan
  int plain_max_prefill_tokens = 0;    // largest chunk without a plan
  // The non-empty row groups of the decode rows, in row order: >= 1 ascending, then 0.
  std::vector<DecodeRowGroup> decode_groups;
  std::vector<int> entry_first_row;      // [entries] row of the entry's first token
  std::vector<int> entry_group;          // [entries] its row_group; 0 without attention
  std::vector<int> entry_prefill_index;  // [entries] index among the prefill chunks (its
                                         // prefill block-table row, the order of their rows),
                                         // -1 for a decode row
  std::vector<int> entry_sample_row;     // [entries] row in the sampled block, or -1
  std::vector<int> entry_host_row;       // [entries] first row in the host block (0 if none)
  std::vector<int> entry_host_rows;      // [entries] rows in the host block
  // The sampled rows' penalties and logit_bias as deltas (BuildLogitDeltas, in sampled-row
  // order) and their CSR offsets [sample rows + 1]; empty deltas: nothing to adjust.
  std::vector<LogitDelta> logit_deltas;
  std::vector<int32_t> logit_delta_offsets;
  std::vector<int> delta_scratch;  // BuildLogitDeltas' sorting buffer

  // The decode rows of `group`; {group, 0, 0} when it has none.
  DecodeRowGroup Group(int group) const;
  bool has_backend_work() const { return backend_rows > 0 || backend_prefill_entries > 0; }
  bool decode_only() const { return prefill_entries == 0; }
  int logit_rows() const { return sample_rows + host_rows; }
  bool adjusts_logits() const { return !logit_deltas.empty(); }
  StepInputCapacity Needs() const;  // backend_bytes 0: the backend's share is its own
};

// The decode attention bucket for sequences of at most `max_len` keys in a cache of
// `cache_tokens` positions: 4096 up to 4096 keys, beyond that max_len rounded up to a multiple
// of max(1024, bit_floor(max_len) / 8), i.e. eight buckets per power of two. The attention grid
// is sized for the bucket, so an oversized bucket spreads the real keys over fewer blocks; this
// keeps the excess at 12.5 % from 8K keys on (25 % just above 4K), while a decoding batch keeps
// one bucket, and one graph, for at least 1024 steps. Never more than the cache holds (and
// never less than max_len).
int DecodeSeqLenBucket(int max_len, int cache_tokens);

// Plans `batch` (validated; entries with attention have row_group >= 1) for a cache of `shape`.
// Reads positions, not block tables.
void PlanForward(std::span<const ForwardEntry> batch, const KvCacheShape& shape, ForwardPlan& plan);

// Writes the model's step inputs of `plan` into `staging` (StepInputLayout::For(capacity) bytes,
// where capacity covers plan.Needs()); the backend's region is the backend's to fill. Every
// entry's block table must cover its new positions.
void FillStepInputs(std::span<const ForwardEntry> batch, const KvCacheShape& shape,
                    const ForwardPlan& plan, const StepInputLayout& layout, std::byte* staging);

// Writes the first `blocks` ids of `sequence`'s table into `row` and zero (a valid block; never
// read) up to `stride`: one block-table row of the step inputs.
void WriteBlockTableRow(const KvSequence& sequence, int blocks, int stride, int32_t* row);

}  // namespace rubato
