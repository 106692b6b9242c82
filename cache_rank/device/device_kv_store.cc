// The GPU cache rank's KV store (device_kv_store.h): the pools, sessions and their budget, and
// the workspaces. The step and its ops: device_kv_store_step.cc.
#include "cache_rank/device/device_kv_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "cache_rank/device/device_step_tables.h"
#include "kernels/cuda/compact_slot_update.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/pooled_top_k.cuh"

namespace rubato {

Result<std::unique_ptr<DeviceKvStore>> DeviceKvStore::Create(const DeviceKvStoreOptions& o) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("device KV store: " + what);
  };
  if (o.num_layers < 1 || o.num_kv_heads < 1 || o.num_query_heads < 1 ||
      o.num_query_heads % o.num_kv_heads != 0) {
    return invalid(
        fmt::format("layers {}, query heads {} / KV heads {}: need positive sizes and "
                    "query heads a multiple of KV heads",
                    o.num_layers, o.num_query_heads, o.num_kv_heads));
  }
  if (o.head_dim < 8 || o.head_dim % 8 != 0) {
    return invalid(fmt::format("head_dim {} must be a positive multiple of 8", o.head_dim));
  }
  if (o.max_batch < 1) return invalid(fmt::format("max_batch {} < 1", o.max_batch));
  if (o.max_step_tokens < 0 || o.max_top_k < 0) {
    return invalid(fmt::format("max_step_tokens {} and max_top_k {} must be >= 0",
                               o.max_step_tokens, o.max_top_k));
  }
  if (o.delta_capacity < 0 || o.delta_capacity > cuda::kMaxCompactSlots ||
      (o.delta_capacity > 0 && (o.max_top_k < 1 || o.max_delta_sessions < 1))) {
    return invalid(
        fmt::format("delta_capacity {} (max {}) with max_top_k {} and "
                    "max_delta_sessions {}: deltas need a selection and a session",
                    o.delta_capacity, cuda::kMaxCompactSlots, o.max_top_k, o.max_delta_sessions));
  }
  std::unique_ptr<DeviceKvStore> store(new DeviceKvStore());
  store->options_ = o;
  if (store->options_.max_step_tokens == 0) store->options_.max_step_tokens = o.max_batch;

  KvCacheShape shape{o.num_layers, o.num_kv_heads, o.head_dim, o.block_tokens, 0};
  const uint64_t block_bytes = 2 * sizeof(__nv_bfloat16) * static_cast<uint64_t>(o.num_layers) *
                               o.num_kv_heads * static_cast<uint64_t>(o.block_tokens) * o.head_dim;
  const uint64_t blocks = o.block_tokens > 0 ? o.budget_bytes / block_bytes : 0;
  if (blocks < 1 || blocks > INT32_MAX) {
    return invalid(
        fmt::format("a budget of {} bytes holds {} blocks of {} bytes ({} tokens x {} "
                    "layers, K and V); need 1 to {}",
                    o.budget_bytes, blocks, block_bytes, o.block_tokens, o.num_layers, INT32_MAX));
  }
  shape.num_blocks = static_cast<int>(blocks);
  auto pools = std::make_unique<Pools>();
  pools->layer_elements = static_cast<size_t>(blocks) * o.num_kv_heads * o.block_tokens *
                          static_cast<size_t>(o.head_dim);
  const size_t elements = pools->layer_elements * static_cast<size_t>(o.num_layers);
  const std::string what =
      fmt::format("the device KV store ({} blocks of {} tokens)", blocks, o.block_tokens);
  RUBATO_ASSIGN_OR_RETURN(pools->keys,
                          cuda::DeviceBuffer<__nv_bfloat16>::Allocate(elements, "K of " + what));
  RUBATO_ASSIGN_OR_RETURN(pools->values,
                          cuda::DeviceBuffer<__nv_bfloat16>::Allocate(elements, "V of " + what));
  // Zeroed: a block's unwritten rows hold finite values (tensor copies read whole blocks).
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(pools->keys.data(), 0, pools->keys.bytes()),
                              "zeroing the K pool");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(pools->values.data(), 0, pools->values.bytes()),
                              "zeroing the V pool");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "zeroing the device KV pools");
  store->pools_ = pools.get();
  // Validates block_tokens (16 or 64).
  RUBATO_ASSIGN_OR_RETURN(store->cache_, PagedKvCache::CreateWithStorage(shape, std::move(pools)));

  if (o.delta_capacity > 0) {
    const size_t map_ints = static_cast<size_t>(o.num_layers) * o.max_delta_sessions *
                            o.num_kv_heads * (1 + static_cast<size_t>(o.delta_capacity));
    RUBATO_ASSIGN_OR_RETURN(store->delta_maps_, cuda::DeviceBuffer<int32_t>::Allocate(
                                                    map_ints, "the device KV store's slot maps"));
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemset(store->delta_maps_.data(), 0, store->delta_maps_.bytes()),
        "zeroing the slot maps");
    RUBATO_ASSIGN_OR_RETURN(
        store->delta_gathered_,
        cuda::DeviceBuffer<int32_t>::Allocate(static_cast<size_t>(o.max_batch) * o.num_kv_heads,
                                              "the device KV store's delta gather counts"));
    for (int m = o.max_delta_sessions - 1; m >= 0; --m) store->free_delta_maps_.push_back(m);
  }
  store->step_ = std::make_unique<StepTables>();
  for (cudaEvent_t& event : store->step_->uploaded) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                "creating the step upload events");
  }
  if (o.max_session_tokens < 0) {
    return invalid(fmt::format("max_session_tokens {} must be >= 0", o.max_session_tokens));
  }
  const int budget_tokens =
      static_cast<int>(std::min<int64_t>(int64_t{shape.num_blocks} * o.block_tokens, INT32_MAX));
  RUBATO_RETURN_IF_ERROR(store->GrowWorkspaces(!o.fixed_workspaces        ? o.block_tokens
                                               : o.max_session_tokens > 0 ? o.max_session_tokens
                                                                          : budget_tokens));
  return store;
}

DeviceKvStore::~DeviceKvStore() {
  for (auto& [id, session] : sessions_) (void)cache_->Release(session->sequence);
}

// Workspaces and tables for max_batch entries of `capacity_tokens`; grows only. Synchronizes
// the device first: no op in flight may use the buffers replaced.
Status DeviceKvStore::GrowWorkspaces(int capacity_tokens) {
  if (capacity_tokens <= workspace_capacity_) return Status::Ok();
  RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "device KV store: growing workspaces");
  const DeviceKvStoreOptions& o = options_;
  const int cap = capacity_tokens;
  RUBATO_ASSIGN_OR_RETURN(attention_workspace_,
                          cuda::DeviceBuffer<std::byte>::Allocate(
                              cuda::DecodeAttentionWorkspaceBytes(o.max_batch, o.num_query_heads,
                                                                  o.head_dim, cap, false),
                              "the device KV store's attention workspace"));
  if (o.max_top_k > 0) {
    scores_ = {};
    RUBATO_ASSIGN_OR_RETURN(scores_, cuda::DeviceBuffer<float>::Allocate(
                                         static_cast<size_t>(o.max_batch) * o.num_query_heads * cap,
                                         "the device KV store's selection scores"));
    RUBATO_ASSIGN_OR_RETURN(
        top_k_workspace_,
        cuda::DeviceBuffer<std::byte>::Allocate(
            cuda::PooledTopKWorkspaceBytes(o.max_batch, o.num_query_heads, o.num_kv_heads, cap),
            "the device KV store's top-k workspace"));
    if (selected_.size() == 0) {
      const size_t pairs = static_cast<size_t>(o.max_batch) * o.num_kv_heads;
      RUBATO_ASSIGN_OR_RETURN(selected_, cuda::DeviceBuffer<int32_t>::Allocate(
                                             pairs * o.max_top_k, "selected positions"));
      RUBATO_ASSIGN_OR_RETURN(selected_count_,
                              cuda::DeviceBuffer<int32_t>::Allocate(pairs, "selected counts"));
    }
  }
  // The tables: the new device copy keeps the step in progress (its sections do not move).
  StepTables& step = *step_;
  const int stride = cache_->BlocksFor(cap);
  const TablesLayout layout = LayoutTables(o.max_batch, o.max_step_tokens, stride);
  RUBATO_ASSIGN_OR_RETURN(auto device, cuda::DeviceBuffer<std::byte>::Allocate(
                                           layout.total, "the device KV store's step tables"));
  if (step.device.size() > 0) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaMemcpy(device.data(), step.device.data(), step.device.bytes(),
                                           cudaMemcpyDeviceToDevice),
                                "device KV store: keeping the step tables");
  }
  for (std::byte*& staging : step.staging) {
    if (staging != nullptr) cudaFreeHost(staging);
    staging = nullptr;
    void* pinned = nullptr;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, layout.total, cudaHostAllocDefault),
                                "device KV store: pinned step tables");
    staging = static_cast<std::byte*>(pinned);
  }
  step.device = std::move(device);
  step.layout = layout;
  step.max_stride = stride;
  workspace_capacity_ = cap;
  return Status::Ok();
}

Result<uint64_t> DeviceKvStore::OpenSession(uint64_t request_id, const SessionShape& shape) {
  const DeviceKvStoreOptions& o = options_;
  if (shape.num_layers != static_cast<uint32_t>(o.num_layers) ||
      shape.num_kv_heads != static_cast<uint32_t>(o.num_kv_heads) ||
      shape.num_query_heads != static_cast<uint32_t>(o.num_query_heads) ||
      shape.head_dim != static_cast<uint32_t>(o.head_dim) || shape.dtype != DType::kBF16) {
    return InvalidArgumentError(fmt::format(
        "device KV store: session of {} layers, {} / {} heads, head_dim {}, {} does not match "
        "the store's {} layers, {} / {} heads, head_dim {}, bf16",
        shape.num_layers, shape.num_query_heads, shape.num_kv_heads, shape.head_dim,
        DTypeName(shape.dtype), o.num_layers, o.num_query_heads, o.num_kv_heads, o.head_dim));
  }
  if (shape.capacity_tokens < 1 || shape.capacity_tokens > INT32_MAX) {
    return InvalidArgumentError(fmt::format("device KV store: capacity_tokens {} outside [1, {}]",
                                            shape.capacity_tokens, INT32_MAX));
  }
  if (session_of_request_.contains(request_id)) {
    return InvalidArgumentError(
        fmt::format("device KV store: request {} already has a session", request_id));
  }
  auto session = std::make_unique<Session>();
  session->request_id = request_id;
  session->capacity_tokens = shape.capacity_tokens;
  const int capacity = static_cast<int>(shape.capacity_tokens);
  if (!cache_->Reserve(session->sequence, capacity).ok()) {
    const uint64_t block_bytes = cache_->pool_bytes() / cache_->shape().num_blocks;
    return ResourceExhaustedError(fmt::format(
        "device KV store: a session of {} tokens needs {} bytes ({} blocks); {} of the budget "
        "of {} bytes are in use ({} blocks free)",
        capacity, block_bytes * cache_->BlocksFor(capacity), cache_->BlocksFor(capacity),
        block_bytes * cache_->used_blocks(), cache_->pool_bytes(), cache_->free_blocks()));
  }
  // After the budget, so that a session over both is refused naming the budget.
  if (o.fixed_workspaces && shape.capacity_tokens > static_cast<uint32_t>(workspace_capacity_)) {
    (void)cache_->Release(session->sequence);
    return InvalidArgumentError(fmt::format(
        "device KV store: a session of {} tokens is longer than the {} its fixed workspaces hold "
        "(max_session_tokens)",
        shape.capacity_tokens, workspace_capacity_));
  }
  if (o.delta_capacity > 0 && free_delta_maps_.empty()) {
    (void)cache_->Release(session->sequence);
    return ResourceExhaustedError(fmt::format(
        "device KV store: all max_delta_sessions {} slot maps are in use", o.max_delta_sessions));
  }
  if (Status grown = GrowWorkspaces(capacity); !grown.ok()) {
    (void)cache_->Release(session->sequence);
    return grown;
  }
  if (o.delta_capacity > 0) {
    session->delta_map = free_delta_maps_.back();
    free_delta_maps_.pop_back();
  }
  const uint64_t id = next_session_id_++;
  sessions_.emplace(id, std::move(session));
  session_of_request_.emplace(request_id, id);
  return id;
}

Status DeviceKvStore::CloseSession(uint64_t session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFoundError(fmt::format("device KV store: no session {}", session_id));
  }
  const auto& ids = step_->session_ids;
  if (step_->active && std::find(ids.begin(), ids.end(), session_id) != ids.end()) {
    step_->active = false;  // its blocks may be handed out again
  }
  RUBATO_RETURN_IF_ERROR(cache_->Release(it->second->sequence));
  if (it->second->delta_map >= 0) free_delta_maps_.push_back(it->second->delta_map);
  session_of_request_.erase(it->second->request_id);
  sessions_.erase(it);
  return Status::Ok();
}

Result<const DeviceKvStore::Session*> DeviceKvStore::Find(uint64_t session_id) const {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFoundError(fmt::format("device KV store: no session {}", session_id));
  }
  return it->second.get();
}

Status DeviceKvStore::SetSessionLength(uint64_t session_id, uint32_t length) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return NotFoundError(fmt::format("device KV store: no session {}", session_id));
  }
  if (length > it->second->capacity_tokens) {
    return InvalidArgumentError(
        fmt::format("device KV store: length {} past session {}'s capacity {}", length, session_id,
                    it->second->capacity_tokens));
  }
  it->second->length = length;
  return Status::Ok();
}

Result<uint32_t> DeviceKvStore::SessionLength(uint64_t session_id) const {
  RUBATO_ASSIGN_OR_RETURN(const Session* session, Find(session_id));
  return session->length;
}

Result<std::vector<int32_t>> DeviceKvStore::BlockTable(uint64_t session_id) const {
  RUBATO_ASSIGN_OR_RETURN(const Session* session, Find(session_id));
  return session->sequence.block_table;
}

Result<uint32_t> DeviceKvStore::SessionCapacity(uint64_t session_id) const {
  RUBATO_ASSIGN_OR_RETURN(const Session* session, Find(session_id));
  return session->capacity_tokens;
}

Result<std::span<const int32_t>> DeviceKvStore::BlockTableView(uint64_t session_id) const {
  RUBATO_ASSIGN_OR_RETURN(const Session* session, Find(session_id));
  return std::span<const int32_t>(session->sequence.block_table);
}

__nv_bfloat16* DeviceKvStore::mutable_layer_keys(int layer) {
  return pools_->keys.data() + pools_->layer_elements * static_cast<size_t>(layer);
}

__nv_bfloat16* DeviceKvStore::mutable_layer_values(int layer) {
  return pools_->values.data() + pools_->layer_elements * static_cast<size_t>(layer);
}

const __nv_bfloat16* DeviceKvStore::layer_keys(int layer) const {
  return pools_->keys.data() + pools_->layer_elements * static_cast<size_t>(layer);
}

const __nv_bfloat16* DeviceKvStore::layer_values(int layer) const {
  return pools_->values.data() + pools_->layer_elements * static_cast<size_t>(layer);
}

DeviceKvStoreStats DeviceKvStore::Stats() const {
  DeviceKvStoreStats stats;
  stats.sessions_open = sessions_.size();
  stats.budget_bytes = cache_->pool_bytes();
  stats.bytes_reserved = cache_->pool_bytes() / cache_->shape().num_blocks * cache_->used_blocks();
  stats.device_bytes = cache_->pool_bytes() + step_->device.bytes() + attention_workspace_.bytes() +
                       scores_.bytes() + top_k_workspace_.bytes() + selected_.bytes() +
                       selected_count_.bytes() + delta_maps_.bytes() + delta_gathered_.bytes();
  stats.steps = steps_;
  stats.tokens_appended = tokens_appended_;
  return stats;
}

}  // namespace rubato
