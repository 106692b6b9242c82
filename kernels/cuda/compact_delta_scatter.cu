// Compact delta scatter (compact_delta_scatter.cuh): kernel, launcher, validation. A pure copy
// in 16-byte pieces (8 bf16): each thread moves one piece of an entering K row and the same
// piece of its V row into the row's slot.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "kernels/cuda/compact_delta_scatter.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_checks.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;

// ---- kernel -----------------------------------------------------------------------------------

// grid.x covers rows x head_dim / 8 pieces of one (sequence, KV head); grid.y strides over the
// batch * num_kv_heads pairs. Block 0 of a pair also writes its count and empties the
// positions past it.
__global__ void __launch_bounds__(kThreads)
    ScatterCompactDeltaKernel(const CompactDeltaScatterParams p) {
  const int vectors_per_row = p.head_dim / 8;
  const int64_t piece = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int row = static_cast<int>(piece / vectors_per_row);
  const int column = static_cast<int>(piece % vectors_per_row) * 8;
  const int64_t pairs = static_cast<int64_t>(p.batch) * p.num_kv_heads;
  for (int64_t pair = blockIdx.y; pair < pairs; pair += gridDim.y) {
    const int sequence = static_cast<int>(pair / p.num_kv_heads);
    const int kv_head = static_cast<int>(pair % p.num_kv_heads);
    const int pool = p.pool_index[sequence];
    if (pool < 0 || pool >= p.num_pools) continue;
    const int64_t pool_pair = static_cast<int64_t>(pool) * p.num_kv_heads + kv_head;
    const int count = min(max(p.counts[pair], 0), p.capacity);
    if (blockIdx.x == 0) {
      if (threadIdx.x == 0) p.pool_counts[pool_pair] = count;
      for (int s = count + threadIdx.x; s < p.capacity; s += kThreads) {
        p.pool_positions[pool_pair * p.capacity + s] = -1;
      }
    }
    if (row >= p.rows) continue;
    const int64_t entry = pair * p.rows + row;
    const int slot = p.slots[entry];
    if (slot < 0 || slot >= count) continue;
    if (column == 0) p.pool_positions[pool_pair * p.capacity + slot] = p.positions[entry];
    const int64_t source = entry * p.head_dim + column;
    const int64_t dest = (pool_pair * p.capacity + slot) * p.head_dim + column;
    *reinterpret_cast<uint4*>(p.pool_keys + dest) =
        *reinterpret_cast<const uint4*>(p.keys + source);
    *reinterpret_cast<uint4*>(p.pool_values + dest) =
        *reinterpret_cast<const uint4*>(p.values + source);
  }
}

Status Validate(const CompactDeltaScatterParams& p);

}  // namespace

// ---- launcher ---------------------------------------------------------------------------------

Status ScatterCompactDelta(const CompactDeltaScatterParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.batch == 0) return Status::Ok();
  // At least one block in x: block 0 writes the counts even when no row enters.
  const int64_t pieces =
      std::max<int64_t>(static_cast<int64_t>(params.rows) * (params.head_dim / 8), 1);
  const int64_t pairs = static_cast<int64_t>(params.batch) * params.num_kv_heads;
  const dim3 grid(static_cast<unsigned>((pieces + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(pairs, kMaxGridY)));
  ScatterCompactDeltaKernel<<<grid, kThreads, 0, stream>>>(params);
  return LaunchStatus("scatter_compact_delta");
}

// ---- validation -------------------------------------------------------------------------------

namespace {

Status Validate(const CompactDeltaScatterParams& p) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("ScatterCompactDelta: " + what);
  };
  if (p.batch < 0) return invalid("batch = " + std::to_string(p.batch) + " must be >= 0");
  if (p.rows < 0) return invalid("rows = " + std::to_string(p.rows) + " must be >= 0");
  if (p.num_kv_heads < 1) {
    return invalid("num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be >= 1");
  }
  if (p.head_dim < 8 || p.head_dim % 8 != 0) {
    return invalid("head_dim = " + std::to_string(p.head_dim) +
                   " must be a positive multiple of 8 (16-byte rows)");
  }
  if (p.capacity < 1) return invalid("capacity = " + std::to_string(p.capacity) + " must be >= 1");
  if (static_cast<int64_t>(p.rows) * (p.head_dim / 8) > static_cast<int64_t>(INT_MAX) * kThreads) {
    return invalid("rows = " + std::to_string(p.rows) + " of head_dim " +
                   std::to_string(p.head_dim) + " exceed the grid");
  }
  if (p.batch == 0) return Status::Ok();
  if (p.num_pools < 1)
    return invalid("num_pools = " + std::to_string(p.num_pools) + " must be >= 1");
  if (p.counts == nullptr) return invalid("counts is null");
  if (p.pool_index == nullptr) return invalid("pool_index is null");
  if (p.pool_keys == nullptr || p.pool_values == nullptr) {
    return invalid("pool_keys and pool_values must be set");
  }
  if (p.pool_counts == nullptr) return invalid("pool_counts is null");
  if (p.pool_positions == nullptr) return invalid("pool_positions is null");
  if (p.rows > 0 &&
      (p.slots == nullptr || p.positions == nullptr || p.keys == nullptr || p.values == nullptr)) {
    return invalid("slots, positions, keys and values must be set when rows > 0");
  }
  for (const void* pointer :
       {static_cast<const void*>(p.keys), static_cast<const void*>(p.values),
        static_cast<const void*>(p.pool_keys), static_cast<const void*>(p.pool_values)}) {
    if (!Aligned16(pointer))
      return invalid(
          "keys, values, pool_keys and pool_values must be "
          "16-byte aligned");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
