// SFI's CUDA step plan and its share of the step inputs (sfi_cuda_backend.h): host only, no
// device calls, so the plan tests run without a GPU.
#include <algorithm>
#include <cstring>

#include "common/sizes.h"
#include "inference_rank/policies/sfi/sfi_cuda_backend.h"

namespace rubato {

bool SfiStepInputCapacity::Covers(const SfiStepInputCapacity& need) const {
  return fast_rows >= need.fast_rows && selections >= need.selections &&
         window_rows >= need.window_rows && window_table_ints >= need.window_table_ints;
}

SfiStepInputCapacity SfiStepInputCapacity::GrownToCover(const SfiStepInputCapacity& need) const {
  SfiStepInputCapacity grown;
  grown.fast_rows = GrowCapacity(fast_rows, need.fast_rows);
  grown.selections = GrowCapacity(selections, need.selections);
  grown.window_rows = GrowCapacity(window_rows, need.window_rows);
  grown.window_table_ints = GrowCapacity(window_table_ints, need.window_table_ints);
  return grown;
}

SfiStepInputLayout SfiStepInputLayout::For(const SfiStepInputCapacity& c) {
  SfiStepInputLayout layout;
  PackedOffsets offsets;
  auto place = [&offsets](size_t& field, int count) {
    field = offsets.Place(sizeof(int32_t) * static_cast<size_t>(count));
  };
  place(layout.fast_slots, c.fast_rows);
  place(layout.recent_begin, c.fast_rows);
  place(layout.fast_positions, c.fast_rows);
  place(layout.slow_slots, c.selections);
  place(layout.sink_end, c.selections);
  place(layout.j_count, c.selections);
  place(layout.selection_q_rows, c.selections);
  place(layout.selection_positions, c.selections);
  place(layout.window_seq_lens, c.window_rows);
  place(layout.window_q_rows, c.window_rows);
  place(layout.window_block_tables, c.window_table_ints);
  layout.bytes = offsets.bytes();
  return layout;
}

SfiStepInputCapacity SfiStepPlan::Needs(const ForwardPlan& plan) const {
  SfiStepInputCapacity need;
  need.fast_rows = fast_rows;
  need.selections = selections;
  need.window_rows = window_rows;
  need.window_table_ints = window_rows * plan.prefill_table_stride;
  return need;
}

void PlanSfiStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const SfiPolicyConfig& config, SfiStepPlan& sfi) {
  sfi = SfiStepPlan{};
  sfi.entry_selection.assign(batch.size(), -1);
  const DecodeRowGroup fast = plan.Group(kSfiFastRows);
  const DecodeRowGroup slow = plan.Group(kSfiSlowRows);
  sfi.fast_first_row = fast.first_row;
  sfi.fast_rows = fast.rows;
  sfi.slow_first_row = slow.first_row;
  sfi.slow_rows = slow.rows;
  sfi.selections = slow.rows;
  int longest_recent = 0;  // over the fast rows
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    if (entry.attention == nullptr) continue;
    const int tokens = static_cast<int>(entry.tokens.size());
    if (plan.entry_prefill_index[e] < 0) {  // a decode row
      const int row = plan.entry_first_row[e];
      if (IsSfiFastPlan(*entry.attention)) {
        longest_recent = std::max(longest_recent,
                                  entry.start_position + 1 - entry.attention->action.recent_begin);
      } else {
        sfi.entry_selection[e] = row - slow.first_row;
      }
      continue;
    }
    // A prompt's last chunk (a slow entry: fast entries are one token, model.cc).
    const int length = entry.start_position + tokens;
    SfiWindowPlan window;
    window.entry = static_cast<int>(e);
    window.prefill_index = plan.entry_prefill_index[e];
    window.window = entry.attention->window_queries;
    window.first_row = sfi.window_rows;
    window.length = length;
    window.j_count = SfiAnchor(config, length) - SfiSinkEnd(config, length);
    sfi.windows.push_back(window);
    sfi.window_rows += window.window;
    sfi.window_max_seq_len = std::max(sfi.window_max_seq_len, length);
    sfi.entry_selection[e] = sfi.selections++;
  }
  if (sfi.fast_rows > 0) {
    // What the schedule allows (at most t_max fast steps after the slow step that set the
    // anchor at most recent_window positions back), so that the grid, and a graph, stay the
    // same from one slow step to the next; a caller running more fast steps gets a bucket of
    // its own. Never more than the decode bucket, which holds every row's keys.
    const int64_t allowed = std::min<int64_t>(
        static_cast<int64_t>(config.recent_window) + config.t_max, plan.decode_max_seq_len);
    sfi.recent_bucket = longest_recent <= allowed
                            ? static_cast<int>(allowed)
                            : std::min(RoundUpPow2(longest_recent), plan.decode_max_seq_len);
  }
  if (sfi.slow_rows > 0) {
    sfi.max_j_count = std::max(0, plan.decode_max_seq_len - config.recent_window);
  }
  const int keys =
      std::max(sfi.slow_rows > 0 ? plan.decode_max_seq_len : 0, sfi.window_max_seq_len);
  sfi.score_stride = CeilDiv(keys, 64) * 64;
}

void FillSfiStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                       const SfiStepPlan& sfi, const SfiPolicyConfig& config,
                       const KvCacheShape& shape, const SfiStepInputLayout& layout,
                       std::span<const int> slots, std::byte* region) {
  auto ints = [region](size_t offset) { return reinterpret_cast<int32_t*>(region + offset); };
  int32_t* fast_slots = ints(layout.fast_slots);
  int32_t* recent_begin = ints(layout.recent_begin);
  int32_t* slow_slots = ints(layout.slow_slots);
  int32_t* sink_end = ints(layout.sink_end);
  int32_t* j_count = ints(layout.j_count);
  int32_t* fast_positions = ints(layout.fast_positions);
  int32_t* selection_q_rows = ints(layout.selection_q_rows);
  int32_t* selection_positions = ints(layout.selection_positions);
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    if (entry.attention == nullptr) continue;
    const int slot = slots.empty() ? -1 : slots[e];
    const int selection = sfi.entry_selection[e];
    if (selection < 0) {  // fast: a decode row of its group
      const int row = plan.entry_first_row[e] - sfi.fast_first_row;
      fast_slots[row] = slot;
      recent_begin[row] = entry.attention->action.recent_begin;
      fast_positions[row] = entry.start_position;
      continue;
    }
    const int tokens = static_cast<int>(entry.tokens.size());
    const int length = entry.start_position + tokens;
    slow_slots[selection] = slot;
    sink_end[selection] = SfiSinkEnd(config, length);
    j_count[selection] = SfiAnchor(config, length) - sink_end[selection];
    // The query the selection answers: the entry's last (a decode row's only one, or the last of
    // a prompt chunk's window rows), as the CPU backend remembers it.
    selection_q_rows[selection] = plan.entry_first_row[e] + tokens - 1;
    selection_positions[selection] = length - 1;
  }
  // Window rows: the chunk's last W queries, each attending all of the chunk's keys.
  int32_t* window_lens = ints(layout.window_seq_lens);
  int32_t* window_q_rows = ints(layout.window_q_rows);
  int32_t* window_tables = ints(layout.window_block_tables);
  for (const SfiWindowPlan& window : sfi.windows) {
    const ForwardEntry& entry = batch[static_cast<size_t>(window.entry)];
    const int last_row = plan.entry_first_row[static_cast<size_t>(window.entry)] +
                         static_cast<int>(entry.tokens.size()) - 1;
    for (int i = 0; i < window.window; ++i) {
      const int row = window.first_row + i;
      window_lens[row] = window.length;
      window_q_rows[row] = last_row - (window.window - 1) + i;
      WriteBlockTableRow(*entry.sequence, CeilDiv(window.length, shape.block_tokens),
                         plan.prefill_table_stride,
                         window_tables + static_cast<size_t>(row) * plan.prefill_table_stride);
    }
  }
}

}  // namespace rubato
