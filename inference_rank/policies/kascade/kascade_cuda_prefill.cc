// Kascade's tile-sparse prefill on the CUDA model (see kascade_cuda_prefill.h).
#include "inference_rank/policies/kascade/kascade_cuda_prefill.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/sizes.h"
#include "kernels/cpu/tile_gather_attention.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/pooled_top_k.cuh"
#include "kernels/cuda/prefill_attention.cuh"

namespace rubato {
namespace {

// Ints of one step-input array of `capacity` elements, 16-byte aligned.
size_t ArrayInts(int capacity) { return Align16(sizeof(int32_t) * capacity) / sizeof(int32_t); }

}  // namespace

Status KascadeCudaPrefill::Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                                   const std::function<void()>& drop_graphs) {
  const int tile = config_.prefill_tile;
  first_entry_ = plan.prefill_entries - plan.backend_prefill_entries;
  chunks_.assign(static_cast<size_t>(plan.backend_prefill_entries), Chunk{});
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].attention == nullptr || batch[e].tokens.size() == 1) continue;
    Chunk& chunk = chunks_.at(static_cast<size_t>(plan.entry_prefill_index[e] - first_entry_));
    chunk.start = batch[e].start_position;
    chunk.tokens = static_cast<int>(batch[e].tokens.size());
    chunk.tiles = TileGatherTiles(chunk.start, chunk.tokens, tile);
  }
  tile_base_.clear();
  tile_begin_.clear();
  tile_k_.clear();
  rows_ = max_tokens_ = max_begin_ = k_capacity_ = 0;
  for (const Chunk& chunk : chunks_) {
    tile_base_.push_back(static_cast<int32_t>(tile_begin_.size()));
    for (int t = 0; t < chunk.tiles; ++t) {
      const int begin = (chunk.start / tile + t) * tile;
      const int k = std::min(begin, KascadeTopK(config_, begin + tile));
      tile_begin_.push_back(begin);
      tile_k_.push_back(k);
      max_begin_ = std::max(max_begin_, begin);
      k_capacity_ = std::max(k_capacity_, k);
    }
    rows_ += chunk.tokens;
    max_tokens_ = std::max(max_tokens_, chunk.tokens);
  }
  if (chunks_.empty()) return Status::Ok();

  const int chunks = static_cast<int>(chunks_.size());
  const int tiles = static_cast<int>(tile_begin_.size());
  if (chunks > chunk_capacity_ || tiles > tile_capacity_) {
    drop_graphs();  // the step-input region's layout follows the capacities
    chunk_capacity_ = std::max(chunk_capacity_, RoundUpPow2(chunks));
    tile_capacity_ = std::max(tile_capacity_, RoundUpPow2(tiles));
  }
  pooled_stride_ = (static_cast<int64_t>(std::max(max_begin_, 1)) + 63) / 64 * 64;
  k_capacity_ = std::max(k_capacity_, 1);
  const size_t kv_heads = static_cast<size_t>(model_.num_kv_heads);
  const size_t pairs = static_cast<size_t>(tiles) * kv_heads;
  const size_t prefill_rows = static_cast<size_t>(plan.tokens - plan.decode_rows);
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(lse_, prefill_rows * model_.num_heads, "kascade prefill lse", drop_graphs));
  RUBATO_RETURN_IF_ERROR(GrowBackendBuffer(pooled_, pairs * static_cast<size_t>(pooled_stride_),
                                           "kascade prefill pooled probabilities", drop_graphs));
  RUBATO_RETURN_IF_ERROR(GrowBackendBuffer(lists_, anchors_ * pairs * k_capacity_,
                                           "kascade prefill selections", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(counts_, anchors_ * pairs, "kascade prefill selections", drop_graphs));
  return GrowBackendBuffer(
      top_k_workspace_,
      cuda::PooledTopKWorkspaceBytes(tiles, model_.num_kv_heads, model_.num_kv_heads, max_begin_),
      "kascade prefill top-k workspace", drop_graphs);
}

size_t KascadeCudaPrefill::StepInputBytes() const {
  return sizeof(int32_t) * (ArrayInts(chunk_capacity_) + 3 * ArrayInts(tile_capacity_));
}

// [chunk capacity] tile_base, then [tile capacity] each: first positions, k, zeros.
void KascadeCudaPrefill::FillStepInputs(std::byte* region) const {
  if (chunks_.empty()) return;
  int32_t* base = reinterpret_cast<int32_t*>(region);
  int32_t* begin = base + ArrayInts(chunk_capacity_);
  int32_t* k = begin + ArrayInts(tile_capacity_);
  int32_t* zero = k + ArrayInts(tile_capacity_);
  std::copy(tile_base_.begin(), tile_base_.end(), base);
  std::copy(tile_begin_.begin(), tile_begin_.end(), begin);
  std::copy(tile_k_.begin(), tile_k_.end(), k);
  std::fill(zero, zero + tile_begin_.size(), 0);
}

Status KascadeCudaPrefill::Attend(const CudaLayerContext& layer, const LayerAction& action,
                                  int anchor_slot, int source_slot, const int32_t* head_map,
                                  const std::byte* region) {
  if (chunks_.empty()) return Status::Ok();
  const auto* inputs = reinterpret_cast<const int32_t*>(region);
  const int32_t* tile_base = inputs;
  const int32_t* tile_begin = tile_base + ArrayInts(chunk_capacity_);
  const int32_t* tile_k = tile_begin + ArrayInts(tile_capacity_);
  const int32_t* tile_zero = tile_k + ArrayInts(tile_capacity_);
  const ForwardPlan& plan = *layer.plan;
  const int q_dim = model_.q_dim();
  const int64_t qkv_dim = q_dim + 2 * model_.kv_dim();
  const size_t first_row = static_cast<size_t>(plan.decode_rows);
  const size_t kv_heads = static_cast<size_t>(model_.num_kv_heads);
  const size_t pairs = tile_begin_.size() * kv_heads;

  // The chunks' launch: rows relative to the first prefill row (query_start is not rebased).
  cuda::PrefillAttentionParams p;
  p.q = layer.qkv + first_row * qkv_dim;
  p.q_row_stride = qkv_dim;
  p.key_pool = layer.kv->layer_keys(layer.layer);
  p.value_pool = layer.kv->layer_values(layer.layer);
  p.block_tables =
      layer.prefill_block_tables + static_cast<size_t>(first_entry_) * plan.prefill_table_stride;
  p.block_table_stride = plan.prefill_table_stride;
  p.query_start = layer.prefill_query_start + first_entry_;
  p.start_position = layer.prefill_start_positions + first_entry_;
  p.entries = static_cast<int>(chunks_.size());
  p.total_tokens = rows_;
  p.max_query_tokens = max_tokens_;
  p.num_heads = model_.num_heads;
  p.num_kv_heads = model_.num_kv_heads;
  p.head_dim = model_.head_dim;
  p.block_tokens = layer.kv->shape().block_tokens;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(model_.head_dim)));
  p.out = layer.attention + first_row * q_dim;
  p.out_row_stride = q_dim;
  p.tile_tokens = config_.prefill_tile;
  p.tile_base = tile_base;
  p.lse = lse_.data();
  p.pooled = pooled_.data();
  p.pooled_stride = pooled_stride_;
  p.list_capacity = k_capacity_;
  p.list_heads = model_.num_kv_heads;

  if (action.evidence & kPooledProbs) {
    // Each row's lse (layer 0: from its dense attention, whose output is the rows'), the tiles'
    // summed probabilities before them, and their top k_t.
    p.mode = action.op == AttentionOp::kDense ? cuda::PrefillMode::kDense : cuda::PrefillMode::kLse;
    RUBATO_RETURN_IF_ERROR(cuda::PrefillAttention(p, layer.stream));
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(pooled_.data(), 0, sizeof(float) * pairs * pooled_stride_, layer.stream),
        "kascade prefill: zeroing the pooled probabilities");
    p.mode = cuda::PrefillMode::kPool;
    RUBATO_RETURN_IF_ERROR(cuda::PrefillAttention(p, layer.stream));
    cuda::PooledTopKParams top_k;
    top_k.scores = pooled_.data();
    top_k.scores_stride = pooled_stride_;
    top_k.begin = tile_zero;
    top_k.count = tile_begin;
    top_k.max_count = max_begin_;
    top_k.batch = static_cast<int>(tile_begin_.size());
    top_k.num_heads = model_.num_kv_heads;
    top_k.num_kv_heads = model_.num_kv_heads;
    top_k.k = k_capacity_;
    top_k.row_k = tile_k;
    top_k.pooled_input = true;
    top_k.selected = lists_.data() + static_cast<size_t>(anchor_slot) * pairs * k_capacity_;
    top_k.selected_count = counts_.data() + static_cast<size_t>(anchor_slot) * pairs;
    top_k.workspace = top_k_workspace_.data();
    top_k.workspace_bytes = top_k_workspace_.size();
    RUBATO_RETURN_IF_ERROR(cuda::PooledTopK(top_k, layer.stream));
  }
  if (action.op == AttentionOp::kDense) return Status::Ok();

  // The tiles' lists of the layer's anchor, then each tile's own causal part.
  p.mode = cuda::PrefillMode::kList;
  p.lse = nullptr;
  p.lists = lists_.data() + static_cast<size_t>(source_slot) * pairs * k_capacity_;
  p.list_counts = counts_.data() + static_cast<size_t>(source_slot) * pairs;
  p.head_map = head_map;
  return cuda::PrefillAttention(p, layer.stream);
}

Result<std::vector<std::vector<int>>> KascadeCudaPrefill::Selections(int slot) const {
  const size_t kv_heads = static_cast<size_t>(model_.num_kv_heads);
  const size_t pairs = tile_begin_.size() * kv_heads;
  if (slot < 0 || slot >= anchors_ || pairs == 0) {
    return InvalidArgumentError("kascade prefill: no selections of anchor slot " +
                                std::to_string(slot));
  }
  std::vector<int32_t> lists(pairs * k_capacity_), counts(pairs);
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(lists.data(), lists_.data() + static_cast<size_t>(slot) * pairs * k_capacity_,
                 sizeof(int32_t) * lists.size(), cudaMemcpyDeviceToHost),
      "kascade prefill: reading the selections");
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(counts.data(), counts_.data() + static_cast<size_t>(slot) * pairs,
                 sizeof(int32_t) * counts.size(), cudaMemcpyDeviceToHost),
      "kascade prefill: reading the selection counts");
  std::vector<std::vector<int>> out(pairs);
  for (size_t i = 0; i < pairs; ++i) {
    const int32_t* list = lists.data() + i * k_capacity_;
    out[i].assign(list, list + std::clamp(counts[i], 0, k_capacity_));
    std::sort(out[i].begin(), out[i].end());
  }
  return out;
}

}  // namespace rubato
