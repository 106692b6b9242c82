// Which keys a query may attend: the two-segment plan of docs/design.md §3 reduced to positions. A
// query at position p attends [0, min(sink, p + 1)) ∪ [max(sink, p - recent + 1), p], the sink and
// recent segments (never overlapping); dense causal attention is sink = 0, recent = unbounded.
// The window applies to prefill and decode alike; the CPU reference masks, it never evicts.
// Narrative: docs/kernels_cpu.md "Attention windows".
#pragma once

#include <algorithm>
#include <climits>

namespace rubato {

struct AttentionWindow {
  static constexpr int kUnbounded = INT_MAX;

  int sink_tokens = 0;             // >= 0
  int recent_tokens = kUnbounded;  // >= 1; kUnbounded = every position up to the query

  bool IsDense() const { return sink_tokens == 0 && recent_tokens == kUnbounded; }

  // End (exclusive) of the sink segment seen by the query at `position`.
  int SinkEnd(int position) const { return std::min(sink_tokens, position + 1); }
  // First position of the recent segment seen by the query at `position`; the segment is
  // [RecentBegin, position], empty when RecentBegin > position.
  int RecentBegin(int position) const {
    // position - recent_tokens + 1 cannot overflow: position >= 0 and recent_tokens >= 1.
    return std::max(sink_tokens, position - recent_tokens + 1);
  }
  bool Attends(int query_position, int key_position) const {
    return key_position <= query_position &&
           (key_position < sink_tokens || key_position >= RecentBegin(query_position));
  }
  // How many keys the query at `position` attends (of the position + 1 causal ones).
  int VisibleKeys(int position) const {
    return SinkEnd(position) + std::max(0, position - RecentBegin(position) + 1);
  }

  bool operator==(const AttentionWindow&) const = default;
};

}  // namespace rubato
