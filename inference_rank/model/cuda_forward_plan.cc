// Host-side planning of a CUDA forward and its packed step inputs (cuda_forward_plan.h).
#include "inference_rank/model/cuda_forward_plan.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <utility>

#include "common/sizes.h"

namespace rubato {
namespace {

// Smallest decode attention bucket (short sequences share one launch shape) and smallest step
// between buckets (DecodeSeqLenBucket).
constexpr int kMinDecodeBucket = 4096;
constexpr int kMinDecodeStep = 1024;

}  // namespace

bool StepInputCapacity::Covers(const StepInputCapacity& need) const {
  return tokens >= need.tokens && decode_rows >= need.decode_rows &&
         decode_table_ints >= need.decode_table_ints && prefill_entries >= need.prefill_entries &&
         prefill_table_ints >= need.prefill_table_ints && logit_rows >= need.logit_rows &&
         sample_rows >= need.sample_rows && logit_deltas >= need.logit_deltas &&
         backend_bytes >= need.backend_bytes;
}

StepInputCapacity StepInputCapacity::GrownToCover(const StepInputCapacity& need) const {
  StepInputCapacity grown;
  grown.tokens = GrowCapacity(tokens, need.tokens);
  grown.decode_rows = GrowCapacity(decode_rows, need.decode_rows);
  grown.decode_table_ints = GrowCapacity(decode_table_ints, need.decode_table_ints);
  grown.prefill_entries = GrowCapacity(prefill_entries, need.prefill_entries);
  grown.prefill_table_ints = GrowCapacity(prefill_table_ints, need.prefill_table_ints);
  grown.logit_rows = GrowCapacity(logit_rows, need.logit_rows);
  grown.sample_rows = GrowCapacity(sample_rows, need.sample_rows);
  grown.logit_deltas = GrowCapacity(logit_deltas, need.logit_deltas);
  grown.backend_bytes = std::max(backend_bytes, need.backend_bytes);
  return grown;
}

StepInputLayout StepInputLayout::For(const StepInputCapacity& c) {
  StepInputLayout layout;
  PackedOffsets offsets;
  auto place = [&offsets](size_t& field, size_t bytes) { field = offsets.Place(bytes); };
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
  place(layout.logit_delta_offsets, i32 * static_cast<size_t>(c.sample_rows + 1));
  place(layout.logit_deltas, sizeof(LogitDelta) * static_cast<size_t>(c.logit_deltas));
  place(layout.backend, c.backend_bytes);
  layout.bytes = offsets.bytes();
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
  need.logit_deltas = static_cast<int>(logit_deltas.size());
  return need;
}

DecodeRowGroup ForwardPlan::Group(int group) const {
  for (const DecodeRowGroup& g : decode_groups) {
    if (g.group == group) return g;
  }
  return DecodeRowGroup{group, 0, 0};
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
  plan.entry_group.assign(n, 0);
  plan.entry_prefill_index.assign(n, -1);
  plan.entry_sample_row.assign(n, -1);
  plan.entry_host_row.assign(n, 0);
  plan.entry_host_rows.assign(n, 0);

  // Rows: decode entries first, by row group (>= 1 ascending, then 0), each group in batch
  // order; then prefill chunks (below).
  std::vector<std::pair<int, size_t>> decode;  // (group's place in the row order, entry)
  for (size_t e = 0; e < n; ++e) {
    if (batch[e].attention != nullptr) plan.entry_group[e] = batch[e].attention->row_group;
    if (batch[e].tokens.size() != 1) continue;
    const int group = plan.entry_group[e];
    decode.emplace_back(group == 0 ? std::numeric_limits<int>::max() : group, e);
  }
  std::stable_sort(decode.begin(), decode.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  int row = 0;
  int max_decode_len = 0;
  for (const std::pair<int, size_t>& placed : decode) {
    const size_t e = placed.second;
    const int group = plan.entry_group[e];
    if (plan.decode_groups.empty() || plan.decode_groups.back().group != group) {
      plan.decode_groups.push_back(DecodeRowGroup{group, row, 0});
    }
    ++plan.decode_groups.back().rows;
    if (group != 0) ++plan.backend_rows;
    plan.entry_first_row[e] = row++;
    // Fixed-budget rows attend their slots, never the paged cache: they do not size the bucket.
    if (!IsFixedBudgetEntry(batch[e])) {
      max_decode_len = std::max(max_decode_len, batch[e].start_position + 1);
    }
  }
  plan.decode_rows = row;
  // Prefill chunks: those without an attention plan, then the backend's, each in batch order.
  int max_prefill_len = 0;
  for (const bool with_plan : {false, true}) {
    for (size_t e = 0; e < n; ++e) {
      const ForwardEntry& entry = batch[e];
      const int tokens = static_cast<int>(entry.tokens.size());
      if (tokens == 1 || (entry.attention != nullptr) != with_plan) continue;
      if (with_plan) {
        ++plan.backend_prefill_entries;
        plan.backend_max_prefill_tokens = std::max(plan.backend_max_prefill_tokens, tokens);
      } else {
        plan.plain_prefill_tokens += tokens;
        plan.plain_max_prefill_tokens = std::max(plan.plain_max_prefill_tokens, tokens);
      }
      plan.entry_prefill_index[e] = plan.prefill_entries;
      plan.entry_first_row[e] = row;
      row += tokens;
      ++plan.prefill_entries;
      plan.max_prefill_tokens = std::max(plan.max_prefill_tokens, tokens);
      max_prefill_len = std::max(max_prefill_len, entry.start_position + tokens);
    }
  }
  plan.tokens = row;
  if (plan.decode_rows > 0) {
    plan.decode_max_seq_len =
        DecodeSeqLenBucket(max_decode_len, shape.num_blocks * shape.block_tokens);
    plan.decode_table_stride = CeilDiv(plan.decode_max_seq_len, shape.block_tokens);
  }
  plan.prefill_table_stride = CeilDiv(max_prefill_len, shape.block_tokens);

  // Logit rows: the sampled block, then the host block (docs/cuda_model.md).
  plan.logit_deltas.clear();
  plan.logit_delta_offsets.assign(1, 0);
  for (size_t e = 0; e < n; ++e) {
    if (batch[e].sampling == nullptr) continue;
    plan.entry_sample_row[e] = plan.sample_rows++;
    BuildLogitDeltas(batch[e].sampling->adjustments, plan.delta_scratch, plan.logit_deltas);
    plan.logit_delta_offsets.push_back(static_cast<int32_t>(plan.logit_deltas.size()));
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
                    const ForwardPlan& plan, const StepInputLayout& layout, std::byte* staging) {
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
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    const KvSequence& sequence = *entry.sequence;
    const int tokens = static_cast<int>(entry.tokens.size());
    const int first = plan.entry_first_row[e];
    // A fixed-budget row's K/V go to its slots (the backend writes them): no paged slot, no
    // blocks (its sequence holds none).
    const bool fixed_budget = IsFixedBudgetEntry(entry);
    for (int i = 0; i < tokens; ++i) {
      const int position = entry.start_position + i;
      token_ids[first + i] = entry.tokens[static_cast<size_t>(i)];
      positions[first + i] = position;
      slots[first + i] =
          fixed_budget
              ? -1
              : sequence.block_table[static_cast<size_t>(position / bt)] * bt + position % bt;
    }
    const int end = entry.start_position + tokens;  // keys the entry's last row attends
    if (tokens == 1) {
      decode_lens[first] = end;
      WriteBlockTableRow(sequence, fixed_budget ? 0 : CeilDiv(end, bt), plan.decode_table_stride,
                         decode_tables + static_cast<size_t>(first) * plan.decode_table_stride);
    } else {  // PlanForward placed the chunks' rows in prefill-index order
      const int prefill = plan.entry_prefill_index[e];
      query_start[prefill] = first - plan.decode_rows;
      start_positions[prefill] = entry.start_position;
      WriteBlockTableRow(sequence, CeilDiv(end, bt), plan.prefill_table_stride,
                         prefill_tables + static_cast<size_t>(prefill) * plan.prefill_table_stride);
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
  if (plan.adjusts_logits()) {
    std::memcpy(staging + layout.logit_delta_offsets, plan.logit_delta_offsets.data(),
                sizeof(int32_t) * plan.logit_delta_offsets.size());
    std::memcpy(staging + layout.logit_deltas, plan.logit_deltas.data(),
                sizeof(LogitDelta) * plan.logit_deltas.size());
  }
}

void WriteBlockTableRow(const KvSequence& sequence, int blocks, int stride, int32_t* row) {
  std::copy_n(sequence.block_table.begin(), blocks, row);
  std::fill(row + blocks, row + stride, 0);
}

}  // namespace rubato
