// The cache rank's KV store: sessions with capacity accounting against a byte budget, appending
// the new K / V of KV layer packs, and gathering rows into compact buffers (exact_top_k.h and
// reply_builder.h build on it). Each session owns one allocation reserved at open:
//   keys   [layer][kv_head][capacity_tokens][head_dim]   (session dtype)
//   values [layer][kv_head][capacity_tokens][head_dim]   (session dtype), right after keys
// A step's packs must arrive in layer order (one that repeats or skips layers is refused); rows
// of layers already appended in the step in progress are readable (LayerLength).
// One thread drives the store; Stats() may be called from any thread (atomics).
// Narrative (the step rules in full): docs/disaggregated.md "The KV store".
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache_rank/kv_storage.h"
#include "common/status.h"
#include "transport/layer_pack.h"

namespace rubato {

// Selected positions of one (layer, request): [kv_head][count], ascending positions.
using KvHeadSelection = std::vector<std::vector<int32_t>>;

struct KvStoreOptions {
  uint64_t budget_bytes = 0;                      // store-wide limit on reserved session storage
  std::shared_ptr<KvStorageAllocator> allocator;  // null: MakeHostKvStorageAllocator()
};

struct KvStoreStats {
  uint64_t sessions_open = 0;
  uint64_t bytes_reserved = 0;       // storage reserved by open sessions
  uint64_t bytes_reserved_peak = 0;  // the most bytes_reserved has been
  uint64_t budget_bytes = 0;
  uint64_t appends = 0;         // KV packs appended
  uint64_t bytes_appended = 0;  // K and V bytes written by appends
  uint64_t gathers = 0;         // Gather calls that succeeded
  uint64_t gathered_rows = 0;   // K (and as many V) rows they copied
};

// One (session, layer, kv_head) block of keys or values as stored: [capacity][head_dim].
struct KvHeadRows {
  std::span<const std::byte> keys;    // [capacity_tokens][head_dim], session dtype
  std::span<const std::byte> values;  // [capacity_tokens][head_dim], session dtype
  uint32_t readable_tokens = 0;       // rows [0, readable_tokens) hold data (LayerLength)
  uint32_t head_dim = 0;
  DType dtype = DType::kF32;
};

// The bytes a session of `shape` reserves: 2 (K and V) * layers * kv_heads * capacity *
// head_dim * dtype size; OutOfRange on 64-bit overflow.
Result<uint64_t> KvSessionBytes(const SessionShape& shape);

class KvStore {
 public:
  explicit KvStore(KvStoreOptions options);
  ~KvStore();
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  // Reserves the session's full-capacity storage. kResourceExhausted (bytes asked, in use,
  // budget) over budget; kInvalidArgument for a bad shape or a request id already open.
  Result<uint64_t> OpenSession(uint64_t request_id, const SessionShape& shape);
  Status CloseSession(uint64_t session_id);

  Result<SessionShape> GetSessionShape(uint64_t session_id) const;
  // Tokens stored in every layer (complete steps).
  Result<uint32_t> SessionLength(uint64_t session_id) const;
  // Readable tokens of one layer: SessionLength plus the step in progress's new tokens when
  // this layer of it has been appended.
  Result<uint32_t> LayerLength(uint64_t session_id, uint32_t layer) const;

  // Validates the whole pack against every session it names (ValidateAgainstSession, layer
  // order, contiguous positions, see the file comment) and only then writes: on error nothing
  // is written and no session changes.
  Status AppendKvPack(const LayerPackView& pack);

  // Copies the K and V rows at `positions` (in that order; each below LayerLength) into
  // out_keys / out_values [positions.size()][head_dim] (session dtype), which must hold at
  // least that many bytes. Nothing is written on error.
  Status Gather(uint64_t session_id, uint32_t layer, uint32_t kv_head,
                std::span<const int32_t> positions, std::span<std::byte> out_keys,
                std::span<std::byte> out_values);

  // Read-only access to one head's stored rows, for the selection operations.
  Result<KvHeadRows> HeadRows(uint64_t session_id, uint32_t layer, uint32_t kv_head) const;

  KvStoreStats Stats() const;

 private:
  struct Session;
  Result<const Session*> Find(uint64_t session_id) const;
  Result<Session*> FindMutable(uint64_t session_id);

  KvStoreOptions options_;
  uint64_t next_session_id_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Session>> sessions_;  // by session id
  std::unordered_map<uint64_t, uint64_t> session_of_request_;        // request id -> session

  std::atomic<uint64_t> sessions_open_{0};
  std::atomic<uint64_t> bytes_reserved_{0};
  std::atomic<uint64_t> bytes_reserved_peak_{0};
  std::atomic<uint64_t> appends_{0};
  std::atomic<uint64_t> bytes_appended_{0};
  std::atomic<uint64_t> gathers_{0};
  std::atomic<uint64_t> gathered_rows_{0};
};

}  // namespace rubato
