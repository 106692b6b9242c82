// Compact gather (compact_gather.cuh): kernel, launcher, validation. A pure copy in 16-byte
// pieces (8 bf16): each thread moves one piece of a K row and the same piece of the V row.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_checks.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;

// ---- kernel -----------------------------------------------------------------------------------

// grid.x covers (max_sink_tokens + budget) rows x head_dim / 8 pieces of one (sequence, KV head);
// grid.y strides over the batch * num_kv_heads (sequence, KV head) pairs.
__global__ void __launch_bounds__(kThreads) GatherCompactKvKernel(const CompactGatherParams p) {
  const int vectors_per_row = p.head_dim / 8;
  const int64_t piece = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int row = static_cast<int>(piece / vectors_per_row);
  const int column = static_cast<int>(piece % vectors_per_row) * 8;
  const int64_t pairs = static_cast<int64_t>(p.batch) * p.num_kv_heads;
  for (int64_t pair = blockIdx.y; pair < pairs; pair += gridDim.y) {
    const int sequence = static_cast<int>(pair / p.num_kv_heads);
    const int kv_head = static_cast<int>(pair % p.num_kv_heads);
    // Where the (sequence, KV head) writes: its own pair, or its slot's in a pool.
    int64_t out_pair = pair;
    if (p.compact_slots != nullptr) {
      const int slot = p.compact_slots[sequence];
      if (slot < 0 || slot >= p.num_compact_slots) continue;
      out_pair = static_cast<int64_t>(slot) * p.num_kv_heads + kv_head;
    }
    const int sink = min(max(p.sink_end[sequence], 0), p.max_sink_tokens);
    const int selected = min(max(p.selected_count[pair], 0), p.budget);
    if (piece == 0) p.compact_counts[out_pair] = sink + selected;
    if (row >= sink + selected) continue;
    const int64_t position = row < sink ? row : p.selected[pair * p.budget + (row - sink)];
    if (p.compact_positions != nullptr && column == 0) {
      p.compact_positions[out_pair * p.compact_capacity + row] = static_cast<int32_t>(position);
    }
    const int64_t dest = (out_pair * p.compact_capacity + row) * p.head_dim + column;
    uint4* key_out = reinterpret_cast<uint4*>(p.compact_keys + dest);
    uint4* value_out = reinterpret_cast<uint4*>(p.compact_values + dest);
    const int64_t table_index = position / p.block_tokens;
    const int64_t block =
        position >= 0 && table_index < p.block_table_stride
            ? p.block_tables[sequence * static_cast<int64_t>(p.block_table_stride) + table_index]
            : -1;
    if (block < 0 || block >= p.num_pool_blocks) {
      // 0x7fff in every bf16 lane: a quiet NaN row, so a caller bug shows up in attention.
      const uint4 nan = make_uint4(0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu);
      *key_out = nan;
      *value_out = nan;
      continue;
    }
    // [blocks][num_kv_heads][block_tokens][head_dim]
    const int64_t source =
        ((block * p.num_kv_heads + kv_head) * p.block_tokens + position % p.block_tokens) *
            p.head_dim +
        column;
    *key_out = *reinterpret_cast<const uint4*>(p.key_pool + source);
    *value_out = *reinterpret_cast<const uint4*>(p.value_pool + source);
  }
}

Status Validate(const CompactGatherParams& p);

}  // namespace

// ---- launcher ---------------------------------------------------------------------------------

Status GatherCompactKv(const CompactGatherParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.batch == 0) return Status::Ok();
  // At least one block in x: its piece 0 writes the counts even when no row is copied.
  const int64_t pieces = std::max<int64_t>(
      static_cast<int64_t>(params.max_sink_tokens + params.budget) * (params.head_dim / 8), 1);
  const int64_t pairs = static_cast<int64_t>(params.batch) * params.num_kv_heads;
  const dim3 grid(static_cast<unsigned>((pieces + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(pairs, kMaxGridY)));
  GatherCompactKvKernel<<<grid, kThreads, 0, stream>>>(params);
  return LaunchStatus("gather_compact_kv");
}

// ---- validation -------------------------------------------------------------------------------

namespace {

Status Validate(const CompactGatherParams& p) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("GatherCompactKv: " + what);
  };
  if (p.batch < 0) return invalid("batch = " + std::to_string(p.batch) + " must be >= 0");
  if (p.num_kv_heads < 1) {
    return invalid("num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be >= 1");
  }
  if (p.head_dim < 8 || p.head_dim % 8 != 0) {
    return invalid("head_dim = " + std::to_string(p.head_dim) +
                   " must be a positive multiple of 8 (16-byte rows)");
  }
  if (p.block_tokens < 1) {
    return invalid("block_tokens = " + std::to_string(p.block_tokens) + " must be >= 1");
  }
  if (p.max_sink_tokens < 0) {
    return invalid("max_sink_tokens = " + std::to_string(p.max_sink_tokens) + " must be >= 0");
  }
  if (p.budget < 0) return invalid("budget = " + std::to_string(p.budget) + " must be >= 0");
  const int64_t rows = static_cast<int64_t>(p.max_sink_tokens) + p.budget;
  if (p.compact_capacity < rows) {
    return invalid("compact_capacity = " + std::to_string(p.compact_capacity) +
                   " cannot hold max_sink_tokens + budget = " + std::to_string(rows) + " rows");
  }
  if (rows * (p.head_dim / 8) > static_cast<int64_t>(INT_MAX) * kThreads) {
    return invalid("max_sink_tokens + budget = " + std::to_string(rows) + " rows of head_dim " +
                   std::to_string(p.head_dim) + " exceed the grid");
  }
  if (p.num_pool_blocks < 1) {
    return invalid("num_pool_blocks = " + std::to_string(p.num_pool_blocks) + " must be >= 1");
  }
  if (p.block_table_stride < 1) {
    return invalid("block_table_stride = " + std::to_string(p.block_table_stride) +
                   " must be >= 1");
  }
  if (p.batch == 0) return Status::Ok();  // nothing is read or written
  if (p.key_pool == nullptr) return invalid("key_pool is null");
  if (p.value_pool == nullptr) return invalid("value_pool is null");
  if (p.block_tables == nullptr) return invalid("block_tables is null");
  if (p.sink_end == nullptr) return invalid("sink_end is null");
  if (p.selected_count == nullptr) return invalid("selected_count is null");
  if (p.selected == nullptr && p.budget > 0) return invalid("selected is null");
  if (p.compact_keys == nullptr) return invalid("compact_keys is null");
  if (p.compact_values == nullptr) return invalid("compact_values is null");
  if (p.compact_counts == nullptr) return invalid("compact_counts is null");
  if (!Aligned16(p.key_pool)) return invalid("key_pool is not 16-byte aligned");
  if (!Aligned16(p.value_pool)) return invalid("value_pool is not 16-byte aligned");
  if (!Aligned16(p.compact_keys)) return invalid("compact_keys is not 16-byte aligned");
  if (!Aligned16(p.compact_values)) return invalid("compact_values is not 16-byte aligned");
  if (p.compact_slots != nullptr && p.num_compact_slots < 1) {
    return invalid("compact_slots needs num_compact_slots >= 1, got " +
                   std::to_string(p.num_compact_slots));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
