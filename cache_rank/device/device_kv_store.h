// The GPU cache rank's KV store: sessions' K and V in bf16 on the cache rank's GPU, paged like
// the inference rank's cache, so the kernels/cuda ops run on it as they are:
//   keys, values: [layer][block][kv_head][block_tokens][head_dim], bf16, sized by the budget
// Block accounting is PagedKvCache's (inference_rank/kv/paged_kv_cache.h); a session reserves
// the blocks of its whole capacity at open, so the budget is enforced there. A step is planned
// on the host once (BeginStep: one upload of its tables) and its ops run per layer on the
// caller's stream without host synchronization: append a layer's new K/V from a layer pack's
// sections, decode attention over each session's [0, L) (o and lse, for attention on the cache
// rank), and oracle_topk's selection with the gather of its rows, whole (SelectTopK) or as the
// delta to a peer's persistent compact pool (SelectTopKDelta: a device slot map per session,
// layer and KV head). CPU twin: the host store (cache_rank/kv_store.h), exact_top_k.h,
// CompactSlotMap (transport/compact_delta.h) and the CPU attention ops. Narrative:
// docs/disaggregated.md "The GPU cache rank's store".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "kernels/cuda/device_buffer.h"
#include "transport/layer_pack.h"

namespace rubato {

struct DeviceKvStoreOptions {
  // The model's KV shape; every session of the store has it (bf16).
  int num_layers = 0;
  int num_kv_heads = 0;
  int num_query_heads = 0;    // a multiple of num_kv_heads, GQA group 1, 2, 4 or 8
  int head_dim = 0;           // 64 or 128 (16 and 32 for the tiny test models)
  int block_tokens = 64;      // 16 or 64
  uint64_t budget_bytes = 0;  // K and V pools, allocated at Create: the blocks that fit
  int max_batch = 0;          // entries per step, >= 1
  int max_step_tokens = 0;    // new tokens per step over all entries; 0: max_batch
  int max_top_k = 0;          // the largest top_k a step may select; 0: no SelectTopK
  // true: the workspaces and tables are sized at Create for sessions as long as the whole
  // budget, so that OpenSession never synchronizes the device (a cache rank whose data plane
  // keeps a receive posted on this device, device_attention_server.h, would wait for it).
  bool fixed_workspaces = false;
  // With fixed_workspaces: > 0 sizes the workspaces and tables for sessions of this many tokens
  // instead of the whole budget (OpenSession then refuses a longer session by name).
  int max_session_tokens = 0;
  // SelectTopKDelta: slots of each (session, layer, KV head) slot map (the peer's pool: >= every
  // step's sink_end + top_k, <= cuda::kMaxCompactSlots) and the sessions that may hold maps at
  // once (the maps are allocated at Create). 0: no SelectTopKDelta.
  int delta_capacity = 0;
  int max_delta_sessions = 0;
  // true: a session's deltas restart only when its entry says so (DeviceStepEntry::delta_reset),
  // for a caller that tracks the peer's pools itself and may replay a step's ops from a CUDA
  // graph (the host then never sees the step's SelectTopKDelta); false: also at a session's
  // steps up to its first SelectTopKDelta.
  bool delta_resets_by_caller = false;
};

// One request of a step. Positions [first_position, first_position + new_tokens) are written.
struct DeviceStepEntry {
  uint64_t session_id = 0;
  uint32_t first_position = 0;  // must equal the session's length
  uint32_t new_tokens = 1;      // >= 1
  // Byte offsets from AppendLayer's `source` of this entry's K and V, each
  // [num_kv_heads][new_tokens][head_dim] bf16 (a KV pack's sections; 16-byte multiples).
  uint64_t key_offset = 0;
  uint64_t value_offset = 0;
  // 0: the sections above are head-major ([num_kv_heads][new_tokens][head_dim]). > 0: they are
  // token-major rows, token t's heads at key_offset / value_offset + t * token_stride elements
  // (a model's q|k|v rows: token_stride = q_dim + 2 kv_dim), a multiple of 8.
  uint32_t token_stride = 0;
  // SelectTopK only (the oracle_topk rule, cache_rank/selectors/oracle_topk_selector.h): with
  // L = first_position + new_tokens, recent_begin = max(0, L - recent_tokens), sink_end =
  // min(sink_tokens, recent_begin): rows [0, sink_end), then the top_k of [sink_end,
  // recent_begin) by the GQA-pooled softmax probability of the query (ties low), ascending.
  int top_k = 0;          // in [0, max_top_k]
  int sink_tokens = 0;    // >= 0
  int recent_tokens = 1;  // >= 1
  // SelectTopKDelta only: the peer's pools of this session are empty, so this step's deltas are
  // full replies (every row entering, slot i taking the i-th position). A session's steps up to
  // its first SelectTopKDelta are such anyway.
  bool delta_reset = false;
};

// The step's queries: entry e's [num_query_heads][head_dim] bf16 (after RoPE) at
// q + e * row_stride (a decode KV pack's Q sections: the per-request stride of the pack).
struct DeviceQueries {
  const __nv_bfloat16* q = nullptr;  // 16-byte aligned
  int64_t row_stride = 0;            // elements, a multiple of 8, >= num_query_heads * head_dim
};

struct DeviceAttendOutputs {
  // Head h of entry e at out + e * out_row_stride + h * head_dim, bf16: the softmax-weighted
  // sum of V over [0, L) with scale 1 / sqrt(head_dim).
  __nv_bfloat16* out = nullptr;
  int64_t out_row_stride = 0;  // >= num_query_heads * head_dim
  float* lse = nullptr;        // [batch][num_query_heads], natural log (attention_merge.h)
};

struct DeviceSelectOutputs {
  int capacity = 0;                 // rows per (entry, KV head), >= max sink_end + max top_k
  int32_t* counts = nullptr;        // [batch][num_kv_heads]: sink_end + min(top_k, candidates)
  int32_t* positions = nullptr;     // [batch][num_kv_heads][capacity]; rows >= count untouched
  __nv_bfloat16* keys = nullptr;    // [batch][num_kv_heads][capacity][head_dim], bf16
  __nv_bfloat16* values = nullptr;  // [batch][num_kv_heads][capacity][head_dim], bf16
};

// SelectTopKDelta's outputs, rows per (entry, KV head) = options().delta_capacity (C). The
// delta of entry e's KV head h turns its peer's pool into the new selection's
// (compact_slot_update.cuh; the rule of CompactSlotMap::Update).
struct DeviceDeltaOutputs {
  int32_t* counts = nullptr;        // [batch][num_kv_heads]: the pool's rows in use after it
  int32_t* entering = nullptr;      // [batch][num_kv_heads]: rows entering
  int32_t* slots = nullptr;         // [batch][num_kv_heads][C]: their slots, -1 past them
  int32_t* positions = nullptr;     // [batch][num_kv_heads][C]: their positions, -1 past them
  __nv_bfloat16* keys = nullptr;    // [batch][num_kv_heads][C][head_dim], rows >= entering
  __nv_bfloat16* values = nullptr;  // untouched; same layout
};

struct DeviceKvStoreStats {
  uint64_t sessions_open = 0;
  uint64_t budget_bytes = 0;     // the pools' bytes (the budget rounded down to whole blocks)
  uint64_t bytes_reserved = 0;   // pool bytes of the blocks open sessions hold
  uint64_t device_bytes = 0;     // all device memory the store holds: pools, tables, workspaces
  uint64_t steps = 0;            // BeginStep calls that succeeded
  uint64_t tokens_appended = 0;  // new tokens x layers appended
};

class DeviceKvStore {
 public:
  // Allocates the pools (zeroed) and the step tables on the current device.
  static Result<std::unique_ptr<DeviceKvStore>> Create(const DeviceKvStoreOptions& options);
  ~DeviceKvStore();
  DeviceKvStore(const DeviceKvStore&) = delete;
  DeviceKvStore& operator=(const DeviceKvStore&) = delete;

  // Reserves the blocks of shape.capacity_tokens. The shape must be the store's (bf16).
  // kResourceExhausted naming the budget when the blocks are not free; kInvalidArgument for a
  // shape that is not the store's or a request id already open. Grows the workspaces to the
  // longest open capacity (control plane: may synchronize the device).
  Result<uint64_t> OpenSession(uint64_t request_id, const SessionShape& shape);
  // Returns the session's blocks (a step naming it can run no further op).
  Status CloseSession(uint64_t session_id);
  Result<uint32_t> SessionLength(uint64_t session_id) const;

  // Plans a step over `entries` (distinct open sessions, each at its length, within capacity,
  // at most max_batch entries and max_step_tokens new tokens) and uploads its tables on
  // `stream` from pinned memory. The sessions' lengths advance now; every layer must then be
  // appended (AppendLayer) before it is attended or selected from. All of a step's ops must run
  // on `stream` (or after it). Waits on the host only for the upload of two steps before. A
  // refused step changes nothing.
  Status BeginStep(std::span<const DeviceStepEntry> entries, cudaStream_t stream);
  // The same, with the ops' grids fixed for CUDA graphs: `max_seq_len` bounds every entry's L
  // (within the workspaces: fixed_workspaces) and fixes the grids of scoring and selection, the
  // block tables take the store's widest stride and the sink and top-k bounds are the entries'
  // configured ones, so a step captured once replays while its sessions grow up to the bound.
  Status BeginStep(std::span<const DeviceStepEntry> entries, cudaStream_t stream, int max_seq_len);
  // Takes positions [0, length) of the session as written (within its capacity), with no step:
  // a caller whose planned step never ran, or a benchmark whose pools hold random KV.
  Status SetSessionLength(uint64_t session_id, uint32_t length);

  // Copies the step's new K and V of `layer` from `source` (device, 16-byte aligned; entry e's
  // sections at its key_offset / value_offset) into the sessions' pages.
  Status AppendLayer(int layer, const void* source, cudaStream_t stream);

  // Decode attention of each entry's query over its session's [0, L) of `layer` (L counts the
  // step's new tokens; a prefill entry's query is its last token's).
  Status Attend(int layer, const DeviceQueries& queries, const DeviceAttendOutputs& outputs,
                cudaStream_t stream);

  // The oracle_topk selection of each entry (DeviceStepEntry) from its query at `layer`, and
  // the gather of the selected rows' K and V.
  Status SelectTopK(int layer, const DeviceQueries& queries, const DeviceSelectOutputs& outputs,
                    cudaStream_t stream);
  // The same selection as the delta to each session's peer pool: the session's slot map of
  // `layer` is updated on the device and only the entering rows' K and V are gathered. A caller
  // of deltas runs it on every layer of every step (a skipped layer's map no longer says what
  // the peer's pool holds: reset it with DeviceStepEntry::delta_reset).
  Status SelectTopKDelta(int layer, const DeviceQueries& queries, const DeviceDeltaOutputs& outputs,
                         cudaStream_t stream);

  // One layer's pools, [block][kv_head][block_tokens][head_dim] bf16, and a session's block
  // table (position p is row p % block_tokens of block table[p / block_tokens]).
  const __nv_bfloat16* layer_keys(int layer) const;
  const __nv_bfloat16* layer_values(int layer) const;
  Result<std::vector<int32_t>> BlockTable(uint64_t session_id) const;
  const KvCacheShape& pool_shape() const { return cache_->shape(); }

  // For a caller that plans its own steps over the pools (device_attention_server.h: the
  // model's token-major rows, attended by position): a session's capacity and block table (a
  // view valid until the session closes), and the pools to write.
  Result<uint32_t> SessionCapacity(uint64_t session_id) const;
  Result<std::span<const int32_t>> BlockTableView(uint64_t session_id) const;
  __nv_bfloat16* mutable_layer_keys(int layer);
  __nv_bfloat16* mutable_layer_values(int layer);
  const DeviceKvStoreOptions& options() const { return options_; }

  DeviceKvStoreStats Stats() const;

 private:
  struct Session;
  struct StepTables;
  class Pools;
  DeviceKvStore() = default;
  Result<const Session*> Find(uint64_t session_id) const;
  Status GrowWorkspaces(int capacity_tokens);
  Status CheckStepOp(const char* op, int layer, bool needs_append) const;
  Status CheckQueries(const char* op, const DeviceQueries& queries) const;
  // Scores and pooled top-k of the step's entries at `layer` into selected_ / selected_count_
  // (row stride `budget`); nothing when budget is 0.
  Status ScoreAndSelect(int layer, const DeviceQueries& queries, int budget, cudaStream_t stream);

  DeviceKvStoreOptions options_;
  std::unique_ptr<PagedKvCache> cache_;  // block accounting; owns the device pools (Pools)
  Pools* pools_ = nullptr;               // cache_->storage(), downcast
  uint64_t next_session_id_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Session>> sessions_;  // by session id
  std::unordered_map<uint64_t, uint64_t> session_of_request_;
  int workspace_capacity_ = 0;        // longest session capacity the workspaces hold
  std::unique_ptr<StepTables> step_;  // the step in progress
  // Workspaces, sized for max_batch entries of workspace_capacity_ tokens.
  cuda::DeviceBuffer<std::byte> attention_workspace_;  // DecodeAttentionWorkspaceBytes
  cuda::DeviceBuffer<float> scores_;  // [max_batch][num_query_heads][capacity], log2 units
  cuda::DeviceBuffer<std::byte> top_k_workspace_;  // PooledTopKWorkspaceBytes
  cuda::DeviceBuffer<int32_t> selected_;           // [max_batch][num_kv_heads][max_top_k]
  cuda::DeviceBuffer<int32_t> selected_count_;     // [max_batch][num_kv_heads]
  // Slot maps: [num_layers][max_delta_sessions][num_kv_heads][1 + delta_capacity] int32 (the
  // count, then the position in each slot), zeroed at Create; free map indices.
  cuda::DeviceBuffer<int32_t> delta_maps_;
  cuda::DeviceBuffer<int32_t> delta_gathered_;  // [max_batch][num_kv_heads], gather's counts
  std::vector<int> free_delta_maps_;
  uint64_t steps_ = 0;
  uint64_t tokens_appended_ = 0;
};

}  // namespace rubato
