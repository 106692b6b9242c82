// Builds the cache rank's reply pack for a KV pack (docs/design.md §1 step 3; AsyncSpade §4): per
// layer and request, the selected positions per KV head and the compact K / V rows gathered
// from the store at them, and for a request that asks for it (attention_queries) the attention
// of its query over the stored KV (stored_attention.h; layer_pack.h "reply pack").
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cache_rank/kv_store.h"
#include "common/status.h"
#include "transport/compact_delta.h"
#include "transport/layer_pack.h"

namespace rubato {

// `selections` holds one KvHeadSelection per (layer_index, request) of `kv_pack`, at index
// layer_index * batch + request: num_kv_heads lists of strictly ascending positions, each at
// most the request's reply_slots long and below the layer's readable tokens. Writes the reply
// (same step, layers and request table; kind reply, no query) into out[0, returned size):
// counts, positions padded with -1, K / V rows with rows past each count zeroed, and the
// attention output and log-sum-exp of each request with attention_queries 1 over positions
// [0, first_position + new_tokens). Every selection is checked before anything is written;
// `out` must hold ReplyPackBytes.
Result<uint64_t> BuildReplyPack(KvStore& store, const LayerPackView& kv_pack,
                                std::span<const KvHeadSelection> selections,
                                std::span<std::byte> out);

// The delta reply to a KV pack that asked for deltas (kLayerPackFlagDelta): `deltas` holds, per
// (layer_index, request) at index layer_index * batch + request, one CompactDelta per KV head
// (CompactSlotMap's). The reply's request table is the pack's with delta_rows set to the most
// rows entering any head of the request in any layer and delta_reset to whether its deltas are
// full replies (all of a request's deltas agree); `reply_requests` receives it (the caller sizes
// `out` with ReplyPackBytes of a delta shape over it: call with an empty `out` to learn it).
// Per head: the count after applying, then the entering rows' slots, positions and K / V rows
// (-1 / zero past them). Attention sections as in BuildReplyPack.
Result<uint64_t> BuildDeltaReplyPack(KvStore& store, const LayerPackView& kv_pack,
                                     std::span<const std::vector<CompactDelta>> deltas,
                                     std::vector<LayerPackRequest>& reply_requests,
                                     std::span<std::byte> out);

}  // namespace rubato
