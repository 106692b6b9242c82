// The backend half of an attention policy on the CPU model (cpu_model.h): the compact rows its
// kTwoSegment entries attend and the work it adds before and after each layer's attention.
// Evidence on the CPU is computed by the backend itself from the layer's queries and keys (the
// context below), not emitted by the attention op: the reference has no fused path to keep.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/attention/attention_backend.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/model/model.h"
#include "kernels/cpu/compact_kv_view.h"
#include "kernels/cpu/thread_pool.h"

namespace rubato {

// One forward entry as the CPU model laid out its rows.
struct CpuEntryRows {
  int first_token = 0;  // row of its first token in the batch activations
  int tokens = 0;
  int start_position = 0;
  KvSequence* sequence = nullptr;
  const EntryAttention* attention = nullptr;  // null: dense, not the backend's
  const ResidencyEntry* residency = nullptr;  // ForwardEntry::residency
  const SlotKvForward* slots = nullptr;       // ForwardEntry::slots (kv/slot_kv_pool.h)
};

// What a backend may read (and, for `attention`, write) in one layer of a forward.
struct CpuLayerContext {
  int layer = 0;
  const ModelConfig* config = nullptr;
  PagedKvCache* cache = nullptr;
  std::span<const CpuEntryRows> entries;  // batch order
  const float* q = nullptr;    // [tokens][num_heads][head_dim], f32, after RoPE: every entry's
  ThreadPool* pool = nullptr;  // the model's attention workers
  // [tokens][num_heads][head_dim], f32: the layer's attention output, every entry's rows;
  // a backend writes only the rows of the entries whose op it runs (kFixedBudget).
  float* output = nullptr;
  const float* k = nullptr;  // [tokens][num_kv_heads][head_dim], f32, after RoPE: the new keys
  const float* v = nullptr;  // [tokens][num_kv_heads][head_dim], f32: the new values
};

// A kIndexGather entry's positions in one layer, per KV head (any order, each once). A decode
// token (one tile) attends its list, which may reach its own position; a prefill chunk's
// queries attend the list of their tile of `tile_tokens` absolute positions, all before the
// tile, plus their own tile's positions up to theirs (kernels/cpu/tile_gather_attention.h).
struct GatherPositions {
  const int* const* lists = nullptr;  // [tiles][num_kv_heads]
  const int* counts = nullptr;        // [tiles][num_kv_heads]
  int tiles = 1;                      // the tiles the entry's tokens meet (1 for a decode token)
  int tile_tokens = 0;                // prefill chunks: queries per tile
};

// A kTwoSegment entry's first segment: rows [0, counts[h]) of head h.
struct CompactSegment {
  CompactKvView view;
  const int* counts = nullptr;  // [num_kv_heads]
};

class CpuAttentionBackend : public AttentionBackend {
 public:
  std::string_view backend_name() const final { return "cpu"; }

  // The policy's checks of a batch Model::Forward validated; nothing is reserved yet.
  virtual Status CheckBatch(std::span<const ForwardEntry> /*batch*/) { return Status::Ok(); }
  // Before the layer's attention (after its KV append): e.g. a selection of this very step.
  virtual Status BeforeAttention(const CpuLayerContext& /*layer*/) { return Status::Ok(); }
  // The compact segment kTwoSegment entry `entry` (an index into the context's entries)
  // attends in `layer`; valid until the layer ends.
  virtual Result<CompactSegment> Compact(const CpuLayerContext& layer, int entry) = 0;
  // The positions of those compact rows, [num_kv_heads] lists (row r of head h holds position
  // list[h][r]), for tools that measure what a policy attends (bench/accuracy/fidelity.cc).
  virtual Result<const std::vector<std::vector<int>>*> CompactPositions(
      const CpuLayerContext& /*layer*/, int /*entry*/) {
    return UnsupportedError("this policy's CPU backend does not report its compact positions");
  }
  // The positions kIndexGather entry `entry` attends in `layer`; valid until the layer ends.
  virtual Result<GatherPositions> Positions(const CpuLayerContext& /*layer*/, int /*entry*/) {
    return UnsupportedError("this policy's CPU backend has no index-gather positions");
  }
  // The attention of kFixedBudget entry `entry` (one decode token on evicting KV) in `layer`:
  // the model has written the token's K/V into the entry's slots (their next_slot); the backend
  // writes the token's output rows and each KV head's next_slot for the next token.
  virtual Status AttendFixedBudget(const CpuLayerContext& /*layer*/, int /*entry*/) {
    return UnsupportedError("this policy's CPU backend has no fixed-budget attention");
  }
  // The position each slot of kFixedBudget entry `entry` holds in `layer`, [num_kv_heads][slots]
  // (-1: empty), once AttendFixedBudget ran: the rows the token attended, for tools that measure
  // what a policy keeps (bench/accuracy/fidelity.cc); valid until the entry's next forward.
  virtual Result<std::span<const int32_t>> SlotPositions(const CpuLayerContext& /*layer*/,
                                                         int /*entry*/) {
    return UnsupportedError("this policy's CPU backend does not report its slot positions");
  }
  // After the layer's attention: the policy's work on its evidence (e.g. refresh a selection).
  virtual Status AfterAttention(const CpuLayerContext& /*layer*/) { return Status::Ok(); }
  // After the layer's attention output projection, before the residual add: `residual` holds
  // the layer's input hidden states and `update` what attention adds to them, [tokens][hidden]
  // f32 each (e.g. a calibration's importance of the layer's attention).
  virtual Status AfterAttentionBlock(int /*layer*/, const float* /*residual*/,
                                     const float* /*update*/, int /*tokens*/) {
    return Status::Ok();
  }
  // After every layer of the forward succeeded.
  virtual Status FinishForward(std::span<const ForwardEntry> /*batch*/) { return Status::Ok(); }
};

}  // namespace rubato
