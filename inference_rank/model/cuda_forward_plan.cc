// Host-side planning of a CUDA forward and its packed step inputs (cuda_forward_plan.h).
#include "inference_rank/model/cuda_forward_plan.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace rubato {
namespace {

// Smallest decode attention bucket (short sequences share one launch shape) and smallest step
// between buckets (DecodeSeqLenBucket).
constexpr int kMinDecodeBucket = 4096;
constexpr int kMinDecodeStep = 1024;

size_t Align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

int RoundUpPow2(int value) {
  return value <= 1 ? value : static_cast<int>(std::bit_ceil(static_cast<unsigned>(value)));
}

int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// Writes the first `blocks` ids of `sequence`'s table and zero (a valid block; never read) up
// to `stride`.
void WriteTableRow(const KvSequence& sequence, int blocks, int stride, int32_t* row) {
  std::copy_n(sequence.block_table.begin(), blocks, row);
  std::fill(row + blocks, row + stride, 0);
}

// The decode row groups, in row order (cuda_forward_plan.h).
enum class DecodeKind { kSfiFast, kSfiSlow, kDense };

DecodeKind KindOf(const ForwardEntry& entry) {
  if (entry.sfi == nullptr) return DecodeKind::kDense;
  return entry.sfi->step == SfiStepKind::kFast ? DecodeKind::kSfiFast : DecodeKind::kSfiSlow;
}

// The SFI arrays of the step inputs (StepInputLayout sfi_*).
void FillSfiStepInputs(std::span<const ForwardEntry> batch, const KvCacheShape& shape,
                       const ForwardPlan& plan, const StepInputLayout& layout, std::byte* staging,
                       std::span<const int> sfi_slots) {
  auto ints = [staging](size_t offset) { return reinterpret_cast<int32_t*>(staging + offset); };
  int32_t* fast_slots = ints(layout.sfi_fast_slots);
  int32_t* recent_begin = ints(layout.sfi_recent_begin);
  int32_t* slow_slots = ints(layout.sfi_slow_slots);
  int32_t* sink_end = ints(layout.sfi_sink_end);
  int32_t* j_count = ints(layout.sfi_j_count);
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    if (entry.sfi == nullptr) continue;
    const int slot = sfi_slots.empty() ? -1 : sfi_slots[e];
    const int selection = plan.entry_selection[e];
    if (selection < 0) {  // fast: a decode row of the first group
      const int row = plan.entry_first_row[e];
      fast_slots[row] = slot;
      recent_begin[row] = entry.sfi->state->anchor;
      continue;
    }
    const int length = entry.start_position + static_cast<int>(entry.tokens.size());
    slow_slots[selection] = slot;
    sink_end[selection] = SfiSinkEnd(*entry.sfi->config, length);
    j_count[selection] = SfiAnchor(*entry.sfi->config, length) - sink_end[selection];
  }
  // Window rows: the chunk's last W queries, each attending all of the chunk's keys.
  int32_t* window_lens = ints(layout.sfi_window_seq_lens);
  int32_t* window_q_rows = ints(layout.sfi_window_q_rows);
  int32_t* window_tables = ints(layout.sfi_window_block_tables);
  for (const SfiWindowPlan& window : plan.sfi_windows) {
    const ForwardEntry& entry = batch[static_cast<size_t>(window.entry)];
    const int last_row = plan.entry_first_row[static_cast<size_t>(window.entry)] +
                         static_cast<int>(entry.tokens.size()) - 1;
    for (int i = 0; i < window.window; ++i) {
      const int row = window.first_row + i;
      window_lens[row] = window.length;
      window_q_rows[row] = last_row - (window.window - 1) + i;
      WriteTableRow(*entry.sequence, CeilDiv(window.length, shape.block_tokens),
                    plan.prefill_table_stride,
                    window_tables + static_cast<size_t>(row) * plan.prefill_table_stride);
    }
  }
}

}  // namespace

bool StepInputCapacity::Covers(const StepInputCapacity& need) const {
  return tokens >= need.tokens && decode_rows >= need.decode_rows &&
         decode_table_ints >= need.decode_table_ints && prefill_entries >= need.prefill_entries &&
         prefill_table_ints >= need.prefill_table_ints && logit_rows >= need.logit_rows &&
         sample_rows >= need.sample_rows && sfi_fast_rows >= need.sfi_fast_rows &&
         sfi_selections >= need.sfi_selections && sfi_window_rows >= need.sfi_window_rows &&
         sfi_window_table_ints >= need.sfi_window_table_ints;
}

StepInputCapacity StepInputCapacity::GrownToCover(const StepInputCapacity& need) const {
  auto grow = [](int have, int want) { return have >= want ? have : RoundUpPow2(want); };
  StepInputCapacity grown;
  grown.tokens = grow(tokens, need.tokens);
  grown.decode_rows = grow(decode_rows, need.decode_rows);
  grown.decode_table_ints = grow(decode_table_ints, need.decode_table_ints);
  grown.prefill_entries = grow(prefill_entries, need.prefill_entries);
  grown.prefill_table_ints = grow(prefill_table_ints, need.prefill_table_ints);
  grown.logit_rows = grow(logit_rows, need.logit_rows);
  grown.sample_rows = grow(sample_rows, need.sample_rows);
  grown.sfi_fast_rows = grow(sfi_fast_rows, need.sfi_fast_rows);
  grown.sfi_selections = grow(sfi_selections, need.sfi_selections);
  grown.sfi_window_rows = grow(sfi_window_rows, need.sfi_window_rows);
  grown.sfi_window_table_ints = grow(sfi_window_table_ints, need.sfi_window_table_ints);
  return grown;
}

StepInputLayout StepInputLayout::For(const StepInputCapacity& c) {
  StepInputLayout layout;
  size_t offset = 0;
  auto place = [&offset](size_t& field, size_t bytes) {
    field = offset;
    offset += Align16(bytes);
  };
  const size_t i32 = sizeof(int32_t);
  place(layout.sampling_rows, sizeof(cuda::SamplingRow) * static_cast<size_t>(c.sample_rows));
  place(layout.token_ids, i32 * static_cast<size_t>(c.tokens));
  place(layout.positions, i32 * static_cast<size_t>(c.tokens));
  place(layout.kv_slots, i32 * static_cast<size_t>(c.tokens));
  place(layout.decode_block_tables, i32 * static_cast<size_t>(c.decode_table_ints));
  place(layout.decode_seq_lens, i32 * static_cast<size_t>(c.decode_rows));
  place(layout.prefill_block_tables, i32 * static_cast<size_t>(c.prefill_table_ints));
  place(layout.prefill_query_start, i32 * static_cast<size_t>(c.prefill_entries + 1));
  place(layout.prefill_start_positions, i32 * static_cast<size_t>(c.prefill_entries));
  place(layout.logit_row_indices, i32 * static_cast<size_t>(c.logit_rows));
  place(layout.sfi_fast_slots, i32 * static_cast<size_t>(c.sfi_fast_rows));
  place(layout.sfi_recent_begin, i32 * static_cast<size_t>(c.sfi_fast_rows));
  place(layout.sfi_slow_slots, i32 * static_cast<size_t>(c.sfi_selections));
  place(layout.sfi_sink_end, i32 * static_cast<size_t>(c.sfi_selections));
  place(layout.sfi_j_count, i32 * static_cast<size_t>(c.sfi_selections));
  place(layout.sfi_window_seq_lens, i32 * static_cast<size_t>(c.sfi_window_rows));
  place(layout.sfi_window_q_rows, i32 * static_cast<size_t>(c.sfi_window_rows));
  place(layout.sfi_window_block_tables, i32 * static_cast<size_t>(c.sfi_window_table_ints));
  layout.bytes = offset;
  return layout;
}

StepInputCapacity ForwardPlan::Needs() const {
  StepInputCapacity need;
  need.tokens = tokens;
  need.decode_rows = decode_rows;
  need.decode_table_ints = decode_rows * decode_table_stride;
  need.prefill_entries = prefill_entries;
  need.prefill_table_ints = prefill_entries * prefill_table_stride;
  need.logit_rows = logit_rows();
  need.sample_rows = sample_rows;
  need.sfi_fast_rows = sfi_fast_rows;
  need.sfi_selections = sfi_selections;
  need.sfi_window_rows = sfi_window_rows;
  need.sfi_window_table_ints = sfi_window_rows * prefill_table_stride;
  return need;
}

int DecodeSeqLenBucket(int max_len, int cache_tokens) {
  int64_t bucket = kMinDecodeBucket;
  if (max_len > kMinDecodeBucket) {
    const int power = static_cast<int>(std::bit_floor(static_cast<unsigned>(max_len)));
    const int granularity = std::max<int>(kMinDecodeStep, power / 8);
    bucket = (static_cast<int64_t>(max_len) + granularity - 1) / granularity * granularity;
  }
  return static_cast<int>(std::max<int64_t>(max_len, std::min<int64_t>(bucket, cache_tokens)));
}

void PlanForward(std::span<const ForwardEntry> batch, const KvCacheShape& shape,
                 ForwardPlan& plan) {
  const size_t n = batch.size();
  plan = ForwardPlan{};
  plan.entry_first_row.assign(n, 0);
  plan.entry_sample_row.assign(n, -1);
  plan.entry_host_row.assign(n, 0);
  plan.entry_host_rows.assign(n, 0);
  plan.entry_selection.assign(n, -1);

  // Rows: decode entries first, [SFI fast | SFI slow | dense], then prefill chunks, each group in
  // batch order.
  int row = 0;
  int max_decode_len = 0;
  int longest_recent = 0;  // over the fast rows
  for (const DecodeKind kind : {DecodeKind::kSfiFast, DecodeKind::kSfiSlow, DecodeKind::kDense}) {
    for (size_t e = 0; e < n; ++e) {
      const ForwardEntry& entry = batch[e];
      if (entry.tokens.size() != 1 || KindOf(entry) != kind) continue;
      plan.entry_first_row[e] = row++;
      max_decode_len = std::max(max_decode_len, entry.start_position + 1);
      if (entry.sfi != nullptr) plan.sfi_config = entry.sfi->config;
      if (kind == DecodeKind::kSfiFast) {
        ++plan.sfi_fast_rows;
        longest_recent =
            std::max(longest_recent, entry.start_position + 1 - entry.sfi->state->anchor);
      } else if (kind == DecodeKind::kSfiSlow) {
        plan.entry_selection[e] = plan.sfi_slow_rows++;
      }
    }
  }
  plan.decode_rows = row;
  plan.sfi_selections = plan.sfi_slow_rows;
  int max_prefill_len = 0;
  for (size_t e = 0; e < n; ++e) {
    const ForwardEntry& entry = batch[e];
    const int tokens = static_cast<int>(entry.tokens.size());
    if (tokens == 1) continue;
    if (entry.sfi != nullptr) {  // a slow entry (model.h: fast entries are one token)
      plan.sfi_config = entry.sfi->config;
      const int length = entry.start_position + tokens;
      const SfiPolicyConfig& config = *entry.sfi->config;
      SfiWindowPlan window;
      window.entry = static_cast<int>(e);
      window.prefill_index = plan.prefill_entries;
      window.window = entry.sfi->window_queries;
      window.first_row = plan.sfi_window_rows;
      window.length = length;
      window.j_count = SfiAnchor(config, length) - SfiSinkEnd(config, length);
      plan.sfi_windows.push_back(window);
      plan.sfi_window_rows += window.window;
      plan.sfi_window_max_seq_len = std::max(plan.sfi_window_max_seq_len, length);
      plan.entry_selection[e] = plan.sfi_selections++;
    }
    plan.entry_first_row[e] = row;
    row += tokens;
    ++plan.prefill_entries;
    plan.max_prefill_tokens = std::max(plan.max_prefill_tokens, tokens);
    max_prefill_len = std::max(max_prefill_len, entry.start_position + tokens);
  }
  plan.tokens = row;
  if (plan.decode_rows > 0) {
    plan.decode_max_seq_len =
        DecodeSeqLenBucket(max_decode_len, shape.num_blocks * shape.block_tokens);
    plan.decode_table_stride = CeilDiv(plan.decode_max_seq_len, shape.block_tokens);
  }
  plan.prefill_table_stride = CeilDiv(max_prefill_len, shape.block_tokens);
  if (plan.sfi_config != nullptr) {
    const SfiPolicyConfig& config = *plan.sfi_config;
    if (plan.sfi_fast_rows > 0) {
      // What the schedule allows (at most t_max fast steps after the slow step that set the
      // anchor at most recent_window positions back), so that the grid, and a graph, stay the
      // same from one slow step to the next; a caller running more fast steps gets a bucket of
      // its own. Never more than the decode bucket, which holds every row's keys.
      const int64_t allowed = std::min<int64_t>(
          static_cast<int64_t>(config.recent_window) + config.t_max, plan.decode_max_seq_len);
      plan.sfi_recent_bucket = longest_recent <= allowed
                                   ? static_cast<int>(allowed)
                                   : std::min(RoundUpPow2(longest_recent), plan.decode_max_seq_len);
    }
    if (plan.sfi_slow_rows > 0) {
      plan.sfi_max_j_count = std::max(0, plan.decode_max_seq_len - config.recent_window);
    }
    const int keys =
        std::max(plan.sfi_slow_rows > 0 ? plan.decode_max_seq_len : 0, plan.sfi_window_max_seq_len);
    plan.sfi_score_stride = CeilDiv(keys, 64) * 64;
  }

  // Logit rows: the sampled block, then the host block (see the header).
  for (size_t e = 0; e < n; ++e) {
    if (batch[e].sampling != nullptr) plan.entry_sample_row[e] = plan.sample_rows++;
  }
  for (size_t e = 0; e < n; ++e) {
    int rows = 0;
    if (batch[e].logits == LogitsWanted::kAll) {
      rows = static_cast<int>(batch[e].tokens.size());
    } else if (batch[e].logits == LogitsWanted::kLast && batch[e].sampling == nullptr) {
      rows = 1;
    }
    plan.entry_host_row[e] = plan.host_rows;
    plan.entry_host_rows[e] = rows;
    plan.host_rows += rows;
  }
}

void FillStepInputs(std::span<const ForwardEntry> batch, const KvCacheShape& shape,
                    const ForwardPlan& plan, const StepInputLayout& layout, std::byte* staging,
                    std::span<const int> sfi_slots) {
  auto ints = [staging](size_t offset) { return reinterpret_cast<int32_t*>(staging + offset); };
  int32_t* token_ids = ints(layout.token_ids);
  int32_t* positions = ints(layout.positions);
  int32_t* slots = ints(layout.kv_slots);
  int32_t* decode_tables = ints(layout.decode_block_tables);
  int32_t* decode_lens = ints(layout.decode_seq_lens);
  int32_t* prefill_tables = ints(layout.prefill_block_tables);
  int32_t* query_start = ints(layout.prefill_query_start);
  int32_t* start_positions = ints(layout.prefill_start_positions);
  int32_t* logit_rows = ints(layout.logit_row_indices);
  auto* sampling_rows = reinterpret_cast<cuda::SamplingRow*>(staging + layout.sampling_rows);

  const int bt = shape.block_tokens;
  int prefill = 0;  // prefill entries run in batch order, as PlanForward placed their rows
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    const KvSequence& sequence = *entry.sequence;
    const int tokens = static_cast<int>(entry.tokens.size());
    const int first = plan.entry_first_row[e];
    for (int i = 0; i < tokens; ++i) {
      const int position = entry.start_position + i;
      token_ids[first + i] = entry.tokens[static_cast<size_t>(i)];
      positions[first + i] = position;
      slots[first + i] =
          sequence.block_table[static_cast<size_t>(position / bt)] * bt + position % bt;
    }
    const int end = entry.start_position + tokens;  // keys the entry's last row attends
    if (tokens == 1) {
      decode_lens[first] = end;
      WriteTableRow(sequence, CeilDiv(end, bt), plan.decode_table_stride,
                    decode_tables + static_cast<size_t>(first) * plan.decode_table_stride);
    } else {
      query_start[prefill] = first - plan.decode_rows;
      start_positions[prefill] = entry.start_position;
      WriteTableRow(sequence, CeilDiv(end, bt), plan.prefill_table_stride,
                    prefill_tables + static_cast<size_t>(prefill) * plan.prefill_table_stride);
      ++prefill;
    }

    const int last_row = first + tokens - 1;
    if (plan.entry_sample_row[e] >= 0) {
      logit_rows[plan.entry_sample_row[e]] = last_row;
      const TokenSampling& s = *entry.sampling;
      cuda::SamplingRow& row = sampling_rows[plan.entry_sample_row[e]];
      row.temperature = s.temperature;
      row.top_k = s.top_k;
      row.top_p = s.top_p;
      row.uniform = s.uniform;  // the very draw the CPU twin would use (double)
      row.report_probability = s.report_probability ? 1 : 0;
    }
    const int host_first = plan.sample_rows + plan.entry_host_row[e];
    const int host_rows = plan.entry_host_rows[e];
    const bool all_rows = entry.logits == LogitsWanted::kAll;
    for (int r = 0; r < host_rows; ++r)
      logit_rows[host_first + r] = all_rows ? first + r : last_row;
  }
  query_start[plan.prefill_entries] = plan.tokens - plan.decode_rows;
  if (plan.sfi_config != nullptr) FillSfiStepInputs(batch, shape, plan, layout, staging, sfi_slots);
}

}  // namespace rubato
