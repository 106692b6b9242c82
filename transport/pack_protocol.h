// The data-plane protocol between an inference rank and a cache rank (DESIGN §1 steps 1-4), on
// top of the layer-pack format (layer_pack.h) and a Transport (transport.h):
//
//   inference rank                                   cache rank
//   KV pack header (64 bytes, tag kPackHeaderTag) ->  learns the pack's total size
//   KV pack        (total_bytes, tag kPackTag)    ->  appends K/V, selects, gathers
//                  <- reply pack (ReplyPackBytes of the same shape + table, tag kReplyTag)
//
// Every message has an exact size both sides know before it arrives (the NCCL transport needs
// that): the header's size is fixed, the pack's is in the header, the reply's follows from the
// pack's shape and request table. Packs and replies go in order (the transport keeps order per
// (peer, tag)); each KV pack gets exactly one reply.
//
// What a reply holds is fixed by the session's selection (OpenSession) and the request entry, so
// both sides compute it alike (ReplyRangeFor):
//   * kDense ("offload-dense"): every position [0, L) after the append, L = first_position +
//     new_tokens; the inference rank attends it at the request's next step, whose recent segment
//     is then the new token alone. Equals dense attention.
//   * kTopK ("offload-topk", the sequential baseline that AsyncSpade removes): for a one-token
//     entry, the sink [0, sink_end) and the top_k positions of [sink_end, recent_begin) by the
//     GQA-pooled attention of the pack's query (exact, cache_rank/exact_top_k.h), for the same
//     step: recent_begin = max(0, L - recent_tokens). Prefill chunks (new_tokens > 1) attend
//     locally and get an empty reply. With top_k >= context it equals dense.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>

namespace rubato {

inline constexpr uint64_t kPackHeaderTag = 1;
inline constexpr uint64_t kPackTag = 2;
inline constexpr uint64_t kReplyTag = 3;

enum class OffloadSelection { kDense, kTopK };

// "dense" / "topk": the names of the config and the RPC.
inline std::string_view OffloadSelectionName(OffloadSelection selection) {
  return selection == OffloadSelection::kDense ? "dense" : "topk";
}

// A session's selection rule, chosen at OpenSession.
struct OffloadSelectionParams {
  OffloadSelection selection = OffloadSelection::kDense;
  int top_k = 2048;        // kTopK: selected positions per KV head, >= 1
  int sink_tokens = 4;     // kTopK: leading positions always kept, >= 0
  int recent_tokens = 256;  // kTopK: trailing positions the inference rank reads in place, >= 1
};

// What the reply to one request entry carries: rows [0, sink_end) are the sink positions, then
// the selected ones; `slots` is the entry's reply_slots (rows per KV head, each filled); the
// inference rank's recent segment starts at `recent_begin`.
struct ReplyRange {
  int sink_end = 0;
  int recent_begin = 0;
  int slots = 0;
};

inline ReplyRange ReplyRangeFor(const OffloadSelectionParams& params, int first_position,
                                int new_tokens) {
  const int length = first_position + new_tokens;
  if (params.selection == OffloadSelection::kDense) return {0, length, length};
  if (new_tokens != 1) return {0, length, 0};
  const int recent_begin = std::max(0, length - params.recent_tokens);
  const int sink_end = std::min(params.sink_tokens, recent_begin);
  return {sink_end, recent_begin, sink_end + std::min(params.top_k, recent_begin - sink_end)};
}

}  // namespace rubato
