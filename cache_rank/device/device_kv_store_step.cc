// The GPU cache rank's KV store, its step (device_kv_store.h): BeginStep plans the step on the
// host and uploads its tables once; AppendLayer, Attend and SelectTopK launch the kernels/cuda
// ops on the caller's stream with those tables, never synchronizing.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_set>

#include "cache_rank/device/device_kv_store.h"
#include "cache_rank/device/device_step_tables.h"
#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/compact_slot_update.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/decode_scores.cuh"
#include "kernels/cuda/kv_append_head_major.cuh"
#include "kernels/cuda/pooled_top_k.cuh"

namespace rubato {

Status DeviceKvStore::BeginStep(std::span<const DeviceStepEntry> entries, cudaStream_t stream) {
  return BeginStep(entries, stream, 0);
}

Status DeviceKvStore::BeginStep(std::span<const DeviceStepEntry> entries, cudaStream_t stream,
                                int max_seq_len) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("device KV store: step: " + what);
  };
  const DeviceKvStoreOptions& o = options_;
  const int batch = static_cast<int>(entries.size());
  if (batch < 1 || batch > o.max_batch) {
    return invalid(fmt::format("{} entries; need 1 to max_batch {}", batch, o.max_batch));
  }
  StepTables& step = *step_;
  // Check every entry before anything changes (a refused step leaves the one in progress).
  std::vector<Session*> sessions;
  std::unordered_set<uint64_t> seen;
  int64_t rows = 0;
  for (const DeviceStepEntry& e : entries) {
    auto it = sessions_.find(e.session_id);
    if (it == sessions_.end()) {
      return NotFoundError(fmt::format("device KV store: step: no session {}", e.session_id));
    }
    if (!seen.insert(e.session_id).second) {
      return invalid(fmt::format("session {} appears twice", e.session_id));
    }
    const Session& s = *it->second;
    if (e.first_position != s.length) {
      return invalid(fmt::format("session {}: first_position {} but {} tokens are stored",
                                 e.session_id, e.first_position, s.length));
    }
    if (e.new_tokens < 1 || uint64_t{e.first_position} + e.new_tokens > s.capacity_tokens) {
      return invalid(fmt::format("session {}: {} new tokens at {} (need >= 1, within capacity {})",
                                 e.session_id, e.new_tokens, e.first_position, s.capacity_tokens));
    }
    if (max_seq_len > 0 && e.first_position + e.new_tokens > static_cast<uint64_t>(max_seq_len)) {
      return invalid(
          fmt::format("session {}: {} tokens after the step, past the grid's max_seq_len {}",
                      e.session_id, e.first_position + e.new_tokens, max_seq_len));
    }
    if (e.token_stride % 8 != 0) {
      return invalid(fmt::format("session {}: token_stride {} is not a multiple of 8", e.session_id,
                                 e.token_stride));
    }
    if (e.key_offset % 16 != 0 || e.value_offset % 16 != 0) {
      return invalid(fmt::format("session {}: key_offset {} / value_offset {} not 16-byte aligned",
                                 e.session_id, e.key_offset, e.value_offset));
    }
    if (e.top_k < 0 || e.top_k > o.max_top_k || e.sink_tokens < 0 || e.recent_tokens < 1) {
      return invalid(
          fmt::format("session {}: top_k {} (max_top_k {}), sink_tokens {}, "
                      "recent_tokens {}: need 0 <= top_k <= max_top_k, sink >= 0, "
                      "recent >= 1",
                      e.session_id, e.top_k, o.max_top_k, e.sink_tokens, e.recent_tokens));
    }
    rows += e.new_tokens;
    sessions.push_back(it->second.get());
  }
  if (rows > o.max_step_tokens) {
    return invalid(fmt::format("{} new tokens; max_step_tokens is {}", rows, o.max_step_tokens));
  }
  if (max_seq_len < 0 ||
      (max_seq_len > 0 && (!o.fixed_workspaces || max_seq_len > workspace_capacity_))) {
    return invalid(
        fmt::format("max_seq_len {} needs fixed_workspaces and at most the {} tokens they hold",
                    max_seq_len, workspace_capacity_));
  }

  // Fill a pinned slot once its previous upload ran (two steps ago: normally long done).
  step.active = false;
  const int slot = step.next_slot;
  step.next_slot ^= 1;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(step.uploaded[slot]),
                              "device KV store: waiting for a step table upload");
  const TablesLayout& t = step.layout;
  std::byte* host = step.staging[slot];
  const auto at = [&](size_t offset) { return host + offset; };
  const int block_tokens = cache_->shape().block_tokens;
  int stride = 0;
  for (const Session* s : sessions) {
    stride = std::max(stride, static_cast<int>(s->sequence.block_table.size()));
  }
  if (max_seq_len > 0) stride = step.max_stride;  // every session's table fits the widest
  step.max_len = step.max_sink_end = step.max_top_k = step.max_candidates = 0;
  int row = 0;
  for (int b = 0; b < batch; ++b) {
    const DeviceStepEntry& e = entries[b];
    const std::vector<int32_t>& table = sessions[b]->sequence.block_table;
    for (uint32_t token = 0; token < e.new_tokens; ++token, ++row) {
      const int position = static_cast<int>(e.first_position + token);
      // Head-major sections: token t's head h at t * head_dim + h * new_tokens * head_dim;
      // token-major rows: at t * token_stride + h * head_dim.
      const int64_t token_step = e.token_stride > 0 ? int64_t{e.token_stride} : o.head_dim;
      const int64_t key = static_cast<int64_t>(e.key_offset / 2) + int64_t{token} * token_step;
      const int64_t value = static_cast<int64_t>(e.value_offset / 2) + int64_t{token} * token_step;
      const int32_t head_stride =
          e.token_stride > 0 ? o.head_dim : static_cast<int32_t>(e.new_tokens) * o.head_dim;
      const int32_t slot_id =
          table[position / block_tokens] * block_tokens + position % block_tokens;
      std::memcpy(at(t.key_offsets + row * sizeof(int64_t)), &key, sizeof(key));
      std::memcpy(at(t.value_offsets + row * sizeof(int64_t)), &value, sizeof(value));
      std::memcpy(at(t.head_strides + row * sizeof(int32_t)), &head_stride, sizeof(head_stride));
      std::memcpy(at(t.slots + row * sizeof(int32_t)), &slot_id, sizeof(slot_id));
    }
    const int length = static_cast<int>(e.first_position + e.new_tokens);
    const int recent_begin = std::max(0, length - e.recent_tokens);
    const int sink_end = std::min(e.sink_tokens, recent_begin);
    const bool fresh = !o.delta_resets_by_caller && sessions[b]->delta_fresh;
    const int32_t reset = e.delta_reset || fresh ? 1 : 0;
    const int32_t per_entry[8] = {
        length, sink_end, sink_end, recent_begin - sink_end, e.top_k, sessions[b]->delta_map,
        reset,  0};
    const size_t sections[8] = {t.seq_lens, t.sink_end,  t.begin, t.count,
                                t.row_k,    t.map_index, t.reset, t.zeros};
    for (int i = 0; i < 8; ++i) {
      std::memcpy(at(sections[i] + b * sizeof(int32_t)), &per_entry[i], sizeof(int32_t));
    }
    int32_t* block_row = reinterpret_cast<int32_t*>(at(t.block_tables)) + b * stride;
    std::copy(table.begin(), table.end(), block_row);
    std::fill(block_row + table.size(), block_row + stride, table.back());  // never read
    step.max_len = std::max(step.max_len, length);
    step.max_sink_end = std::max(step.max_sink_end, max_seq_len > 0 ? e.sink_tokens : sink_end);
    step.max_top_k = std::max(step.max_top_k, e.top_k);
    step.max_candidates = std::max(step.max_candidates, recent_begin - sink_end);
  }
  if (max_seq_len > 0) {  // the grids a captured step keeps (BeginStep's overload)
    step.max_len = max_seq_len;
    step.max_candidates = max_seq_len;
  }
  const size_t bytes = t.block_tables + static_cast<size_t>(batch) * stride * sizeof(int32_t);
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(step.device.data(), host, bytes, cudaMemcpyHostToDevice, stream),
      "device KV store: uploading the step tables");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(step.uploaded[slot], stream),
                              "device KV store: recording the step upload");

  step.session_ids.clear();
  for (int b = 0; b < batch; ++b) {
    step.session_ids.push_back(entries[b].session_id);
    sessions[b]->length += entries[b].new_tokens;
  }
  step.batch = batch;
  step.rows = static_cast<int>(rows);
  step.stride = stride;
  step.appended.assign(static_cast<size_t>(o.num_layers), 0);
  step.active = true;
  ++steps_;
  return Status::Ok();
}

Status DeviceKvStore::CheckStepOp(const char* op, int layer, bool needs_append) const {
  if (!step_->active) {
    return FailedPreconditionError(fmt::format(
        "device KV store: {}: no step in progress (BeginStep, or a session of it closed)", op));
  }
  if (layer < 0 || layer >= options_.num_layers) {
    return InvalidArgumentError(fmt::format("device KV store: {}: layer {} outside [0, {})", op,
                                            layer, options_.num_layers));
  }
  const bool appended = step_->appended[static_cast<size_t>(layer)] != 0;
  if (needs_append && !appended) {
    return FailedPreconditionError(
        fmt::format("device KV store: {}: layer {} of this step is not appended yet", op, layer));
  }
  if (!needs_append && appended) {
    return FailedPreconditionError(
        fmt::format("device KV store: {}: layer {} of this step is already appended", op, layer));
  }
  return Status::Ok();
}

Status DeviceKvStore::CheckQueries(const char* op, const DeviceQueries& queries) const {
  const int64_t row = static_cast<int64_t>(options_.num_query_heads) * options_.head_dim;
  if (queries.q == nullptr || queries.row_stride < row || queries.row_stride % 8 != 0) {
    return InvalidArgumentError(fmt::format(
        "device KV store: {}: queries.q must be set and queries.row_stride ({}) a multiple of 8 "
        ">= num_query_heads * head_dim {}",
        op, queries.row_stride, row));
  }
  return Status::Ok();
}

Status DeviceKvStore::AppendLayer(int layer, const void* source, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(CheckStepOp("AppendLayer", layer, false));
  if (source == nullptr) {
    return InvalidArgumentError("device KV store: AppendLayer: source is null");
  }
  const StepTables& step = *step_;
  cuda::HeadMajorKvAppendParams p;
  p.source = static_cast<const __nv_bfloat16*>(source);
  p.key_offsets = step.Device<int64_t>(step.layout.key_offsets);
  p.value_offsets = step.Device<int64_t>(step.layout.value_offsets);
  p.head_strides = step.Device<int32_t>(step.layout.head_strides);
  p.slots = step.Device<int32_t>(step.layout.slots);
  p.rows = step.rows;
  p.num_kv_heads = options_.num_kv_heads;
  p.head_dim = options_.head_dim;
  p.block_tokens = cache_->shape().block_tokens;
  p.key_pool = pools_->keys.data() + pools_->layer_elements * static_cast<size_t>(layer);
  p.value_pool = pools_->values.data() + pools_->layer_elements * static_cast<size_t>(layer);
  RUBATO_RETURN_IF_ERROR(cuda::AppendHeadMajorKv(p, stream));
  step_->appended[static_cast<size_t>(layer)] = 1;
  tokens_appended_ += static_cast<uint64_t>(step.rows);
  return Status::Ok();
}

Status DeviceKvStore::Attend(int layer, const DeviceQueries& queries,
                             const DeviceAttendOutputs& outputs, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(CheckStepOp("Attend", layer, true));
  RUBATO_RETURN_IF_ERROR(CheckQueries("Attend", queries));
  if (outputs.out == nullptr || outputs.lse == nullptr) {
    return InvalidArgumentError("device KV store: Attend: outputs.out and outputs.lse must be set");
  }
  const StepTables& step = *step_;
  cuda::DecodeAttentionParams p;
  p.q = queries.q;
  p.q_row_stride = queries.row_stride;
  p.key_pool = layer_keys(layer);
  p.value_pool = layer_values(layer);
  p.num_pool_blocks = cache_->shape().num_blocks;  // whole-block tensor copies
  p.block_tables = step.Device<int32_t>(step.layout.block_tables);
  p.block_table_stride = step.stride;
  p.seq_lens = step.Device<int32_t>(step.layout.seq_lens);
  p.batch = step.batch;
  p.num_heads = options_.num_query_heads;
  p.num_kv_heads = options_.num_kv_heads;
  p.head_dim = options_.head_dim;
  p.block_tokens = cache_->shape().block_tokens;
  p.max_seq_len = step.max_len;
  p.scale = 1.f / std::sqrt(static_cast<float>(options_.head_dim));
  p.out = outputs.out;
  p.out_row_stride = outputs.out_row_stride;
  p.lse = outputs.lse;
  p.workspace = attention_workspace_.data();
  p.workspace_bytes = attention_workspace_.bytes();
  return cuda::DecodeAttention(p, stream);
}

Status DeviceKvStore::ScoreAndSelect(int layer, const DeviceQueries& queries, int budget,
                                     cudaStream_t stream) {
  const StepTables& step = *step_;
  const int block_tokens = cache_->shape().block_tokens;
  const int32_t* block_tables = step.Device<int32_t>(step.layout.block_tables);
  if (budget > 0) {
    // Raw scores of every position [0, L) in log2 units, then the pooled top-k of each
    // entry's candidates [sink_end, recent_begin).
    cuda::DecodeScoresParams scores;
    scores.q = queries.q;
    scores.q_row_stride = queries.row_stride;
    scores.key_pool = layer_keys(layer);
    scores.num_pool_blocks = cache_->shape().num_blocks;
    scores.block_tables = block_tables;
    scores.block_table_stride = step.stride;
    scores.seq_lens = step.Device<int32_t>(step.layout.seq_lens);
    scores.batch = step.batch;
    scores.num_heads = options_.num_query_heads;
    scores.num_kv_heads = options_.num_kv_heads;
    scores.head_dim = options_.head_dim;
    scores.block_tokens = block_tokens;
    scores.max_seq_len = step.max_len;
    scores.scale = 1.f / std::sqrt(static_cast<float>(options_.head_dim));
    scores.scores = scores_.data();
    scores.scores_stride = step.max_len;
    RUBATO_RETURN_IF_ERROR(cuda::DecodeScores(scores, stream));

    cuda::PooledTopKParams top;
    top.scores = scores_.data();
    top.scores_stride = step.max_len;
    top.begin = step.Device<int32_t>(step.layout.begin);
    top.count = step.Device<int32_t>(step.layout.count);
    top.max_count = step.max_candidates;
    top.batch = step.batch;
    top.num_heads = options_.num_query_heads;
    top.num_kv_heads = options_.num_kv_heads;
    top.k = budget;
    top.row_k = step.Device<int32_t>(step.layout.row_k);
    top.selected = selected_.data();
    top.selected_count = selected_count_.data();
    top.workspace = top_k_workspace_.data();
    top.workspace_bytes = top_k_workspace_.bytes();
    RUBATO_RETURN_IF_ERROR(cuda::PooledTopK(top, stream));
  }
  return Status::Ok();
}

Status DeviceKvStore::SelectTopK(int layer, const DeviceQueries& queries,
                                 const DeviceSelectOutputs& outputs, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(CheckStepOp("SelectTopK", layer, true));
  RUBATO_RETURN_IF_ERROR(CheckQueries("SelectTopK", queries));
  if (options_.max_top_k < 1) {
    return FailedPreconditionError(
        "device KV store: SelectTopK: the store was created with max_top_k 0 (no selection)");
  }
  const StepTables& step = *step_;
  if (outputs.capacity < step.max_sink_end + step.max_top_k) {
    return InvalidArgumentError(fmt::format(
        "device KV store: SelectTopK: outputs.capacity {} < the step's sink rows {} + top_k {}",
        outputs.capacity, step.max_sink_end, step.max_top_k));
  }
  if (outputs.counts == nullptr || outputs.positions == nullptr || outputs.keys == nullptr ||
      outputs.values == nullptr) {
    return InvalidArgumentError(
        "device KV store: SelectTopK: outputs.counts, positions, keys and values must be set");
  }
  const int block_tokens = cache_->shape().block_tokens;
  const int32_t* block_tables = step.Device<int32_t>(step.layout.block_tables);
  // Nothing to choose among (no candidates or top_k 0 everywhere): the sink rows alone.
  const int budget = step.max_top_k > 0 && step.max_candidates > 0 ? step.max_top_k : 0;
  RUBATO_RETURN_IF_ERROR(ScoreAndSelect(layer, queries, budget, stream));
  cuda::CompactGatherParams gather;
  gather.key_pool = layer_keys(layer);
  gather.value_pool = layer_values(layer);
  gather.num_pool_blocks = cache_->shape().num_blocks;
  gather.block_tables = block_tables;
  gather.block_table_stride = step.stride;
  gather.sink_end = step.Device<int32_t>(step.layout.sink_end);
  gather.max_sink_tokens = step.max_sink_end;
  gather.selected = selected_.data();
  gather.selected_count = selected_count_.data();  // read clamped to [0, budget]
  gather.budget = budget;
  gather.batch = step.batch;
  gather.num_kv_heads = options_.num_kv_heads;
  gather.head_dim = options_.head_dim;
  gather.block_tokens = block_tokens;
  gather.compact_keys = outputs.keys;
  gather.compact_values = outputs.values;
  gather.compact_capacity = outputs.capacity;
  gather.compact_counts = outputs.counts;
  gather.compact_positions = outputs.positions;
  return cuda::GatherCompactKv(gather, stream);
}

Status DeviceKvStore::SelectTopKDelta(int layer, const DeviceQueries& queries,
                                      const DeviceDeltaOutputs& outputs, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(CheckStepOp("SelectTopKDelta", layer, true));
  RUBATO_RETURN_IF_ERROR(CheckQueries("SelectTopKDelta", queries));
  const DeviceKvStoreOptions& o = options_;
  if (o.delta_capacity < 1) {
    return FailedPreconditionError(
        "device KV store: SelectTopKDelta: the store was created with delta_capacity 0 (no "
        "slot maps)");
  }
  const StepTables& step = *step_;
  if (o.delta_capacity < step.max_sink_end + step.max_top_k) {
    return InvalidArgumentError(fmt::format(
        "device KV store: SelectTopKDelta: delta_capacity {} < the step's sink rows {} + top_k {}",
        o.delta_capacity, step.max_sink_end, step.max_top_k));
  }
  if (outputs.counts == nullptr || outputs.entering == nullptr || outputs.slots == nullptr ||
      outputs.positions == nullptr || outputs.keys == nullptr || outputs.values == nullptr) {
    return InvalidArgumentError(
        "device KV store: SelectTopKDelta: outputs.counts, entering, slots, positions, keys and "
        "values must be set");
  }
  const int budget = step.max_top_k > 0 && step.max_candidates > 0 ? step.max_top_k : 0;
  RUBATO_RETURN_IF_ERROR(ScoreAndSelect(layer, queries, budget, stream));

  // The delta to each session's pool: its slot map of this layer updated in place.
  const size_t map_ints = 1 + static_cast<size_t>(o.delta_capacity);
  cuda::CompactSlotUpdateParams update;
  update.maps = delta_maps_.data() +
                static_cast<size_t>(layer) * o.max_delta_sessions * o.num_kv_heads * map_ints;
  update.num_maps = o.max_delta_sessions;
  update.map_index = step.Device<int32_t>(step.layout.map_index);
  update.reset = step.Device<int32_t>(step.layout.reset);
  update.sink_end = step.Device<int32_t>(step.layout.sink_end);
  update.max_sink_tokens = step.max_sink_end;
  update.selected = selected_.data();
  update.selected_count = selected_count_.data();
  update.budget = budget;
  update.batch = step.batch;
  update.num_kv_heads = o.num_kv_heads;
  update.capacity = o.delta_capacity;
  update.counts = outputs.counts;
  update.entering = outputs.entering;
  update.entering_slots = outputs.slots;
  update.entering_positions = outputs.positions;
  RUBATO_RETURN_IF_ERROR(cuda::CompactSlotUpdate(update, stream));
  // The maps now hold this step's selections: later steps send deltas. (This step's other
  // layers still reset: the flag went up with the step's tables.)
  for (const uint64_t id : step.session_ids) sessions_.at(id)->delta_fresh = false;

  // Only the entering rows: compact gather with them as the selection and no sink rows.
  cuda::CompactGatherParams gather;
  gather.key_pool = layer_keys(layer);
  gather.value_pool = layer_values(layer);
  gather.num_pool_blocks = cache_->shape().num_blocks;
  gather.block_tables = step.Device<int32_t>(step.layout.block_tables);
  gather.block_table_stride = step.stride;
  gather.sink_end = step.Device<int32_t>(step.layout.zeros);
  gather.max_sink_tokens = 0;
  gather.selected = outputs.positions;
  gather.selected_count = outputs.entering;
  gather.budget = o.delta_capacity;
  gather.batch = step.batch;
  gather.num_kv_heads = o.num_kv_heads;
  gather.head_dim = o.head_dim;
  gather.block_tokens = cache_->shape().block_tokens;
  gather.compact_keys = outputs.keys;
  gather.compact_values = outputs.values;
  gather.compact_capacity = o.delta_capacity;
  gather.compact_counts = delta_gathered_.data();
  return cuda::GatherCompactKv(gather, stream);
}

}  // namespace rubato
