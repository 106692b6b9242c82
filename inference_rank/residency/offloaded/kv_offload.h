// The offloaded residency's exchange: an entry whose full KV lives on a cache rank. In every
// layer the residency's model half (offloaded_cpu_backend.h, offloaded_cuda_backend.h) hands
// the entry's new K/V (and its last query) to a KvOffloadExchange, which ships them in layer
// packs; a decode token attends the compact KV the exchange returns plus the local recent
// segment through the two-segment op, or takes the attention output it returns (sessions served
// attention on the cache rank); prefill chunks attend locally. The exchange (cache_client.h) owns
// packs, transports and timing; the model half calls it in layer order: LayerComputed, then
// CompactFor or PartialFor per decode entry.
// Narrative: docs/disaggregated.md "The model's side".
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "inference_rank/residency/residency_backend.h"
#include "kernels/cpu/compact_kv_view.h"

namespace rubato {

// Where the buffers an exchange is handed lie.
enum class OffloadMemory { kHost, kDevice };

// One entry's new K/V of one layer, as the model computed them (post q/k-norm and RoPE).
struct OffloadLayerKv {
  uint64_t session_id = 0;           // the entry's session on the cache rank
  int start_position = 0;            // position of the first new token
  int tokens = 0;                    // new tokens (1 in decode, more for a prefill chunk)
  const void* keys = nullptr;        // [tokens][num_kv_heads][head_dim], `dtype`
  const void* values = nullptr;      // [tokens][num_kv_heads][head_dim], `dtype`
  const void* last_query = nullptr;  // [num_heads][head_dim], `dtype`: the last new token's query
  DType dtype = DType::kF32;         // of keys, values and last_query
  OffloadMemory memory = OffloadMemory::kHost;  // where keys, values and last_query lie
};

// A decode token's attention of one layer computed where its KV lives, over every position
// [0, position] (its own included): the token's attention output, and the log-sum-exp that lets
// it be merged with attention over other positions (split-K).
struct OffloadPartial {
  const float* output = nullptr;  // [num_heads][head_dim], f32
  const float* lse = nullptr;     // [num_heads], f32: log(sum of exp(q.k / sqrt(head_dim)))
};

// What a decode token attends in one layer: rows [0, counts[h]) of the compact buffer for KV
// head h, then positions [recent_begin, position + 1) of the local paged cache. The compact rows
// and the recent segment never share a position.
struct OffloadCompactKv {
  CompactKvView compact;        // [num_kv_heads][capacity][head_dim], f32; read only
  const int* counts = nullptr;  // [num_kv_heads]
  int recent_begin = 0;
};

class KvOffloadExchange {
 public:
  virtual ~KvOffloadExchange() = default;

  // Layer `layer` of this forward computed the new K/V of `entries` (every offloaded entry of
  // the batch, in batch order; the same entries in every layer of one forward). The buffers are
  // valid during the call only.
  virtual Status LayerComputed(int layer, std::span<const OffloadLayerKv> entries) = 0;

  // The compact KV the decode token of `session_id` at `position` attends in `layer`; blocks
  // until it has arrived (bounded by the exchange's timeout: kDeadlineExceeded /
  // kUnavailable name the cache rank). Valid until the next LayerComputed or the forward ends.
  virtual Result<OffloadCompactKv> CompactFor(int layer, uint64_t session_id, int position) = 0;

  // Whether decode tokens of `session_id` take their attention from PartialFor (computed where
  // the KV lives) instead of attending CompactFor's KV.
  virtual bool ServesPartialAttention(uint64_t /*session_id*/) const { return false; }
  // The attention of the decode token of `session_id` at `position` in `layer`; blocks like
  // CompactFor and is valid as long.
  virtual Result<OffloadPartial> PartialFor(int /*layer*/, uint64_t session_id, int /*position*/) {
    return FailedPreconditionError("offload: session " + std::to_string(session_id) +
                                   " is not served partial attention");
  }
};

// The engine's handle on a cache rank: sessions per request, the exchange their entries use, and
// whether the data plane still works (cache_client.h implements it).
class KvOffloadClient : public KvOffloadExchange {
 public:
  // A session for a request of up to `capacity_tokens` positions.
  virtual Result<uint64_t> OpenSession(uint64_t request_id, int capacity_tokens) = 0;
  // Also called once the client is broken (its error then means little): the client forgets
  // the session.
  virtual Status CloseSession(uint64_t session_id) = 0;
  // The error that stopped the data plane (every offloaded request is then lost), or ok.
  virtual Status Broken() const = 0;
  // The error that lost `session_id`'s KV while the client serves other sessions (one of
  // several cache ranks is gone: multi_cache.h), or ok. Its exchange calls then return
  // placeholders the engine never uses (it ends the request).
  virtual Status SessionBroken(uint64_t /*session_id*/) const { return Status::Ok(); }
};

// The handle on a ForwardEntry (ForwardEntry::residency): the entry's KV is offloaded through
// `exchange`, in session `session_id`.
struct OffloadForward final : ResidencyEntry {
  OffloadForward() = default;
  OffloadForward(KvOffloadExchange* exchange_in, uint64_t session_id_in)
      : exchange(exchange_in), session_id(session_id_in) {}

  KvOffloadExchange* exchange = nullptr;
  uint64_t session_id = 0;
};

}  // namespace rubato
