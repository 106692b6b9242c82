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
// (peer, tag)); each KV pack gets exactly one reply. What a reply holds (each entry's
// reply_slots) is the session's cache selector's rule (cache_rank/cache_selector.h), named at
// OpenSession, which both sides apply alike.
#pragma once

#include <cstdint>

namespace rubato {

inline constexpr uint64_t kPackHeaderTag = 1;
inline constexpr uint64_t kPackTag = 2;
inline constexpr uint64_t kReplyTag = 3;

}  // namespace rubato
