// Compact slot update (compact_slot_update.cuh): kernel, launcher, validation. One block per
// (sequence, KV head): kept flags from a binary search of each old slot's position in the new
// selection, then block-wide prefix sums rank the free slots and the entering rows, and the
// i-th entering row takes the i-th free slot.
#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/compact_slot_update.cuh"
#include "kernels/cuda/cuda_status.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGridY = 65535;

// ---- kernel -----------------------------------------------------------------------------------

// Exclusive prefix sum of `flag` over the block (one value per thread, in thread order); returns
// it and sets `total` (the block's sum). `warp_sums` is kWarps ints of shared memory.
__device__ int BlockExclusiveSum(int flag, int* warp_sums, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = flag;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += warp_sums[w];
    total += warp_sums[w];
  }
  __syncthreads();  // warp_sums is reused by the next call
  return before + inclusive - flag;
}

// The new selection's i-th position (i < sink + chosen).
__device__ int32_t SelectionAt(const int32_t* selected_row, int sink, int i) {
  return i < sink ? i : selected_row[i - sink];
}

// grid.x: (sequence, KV head) pairs, strided by gridDim.x. Shared memory: kept[capacity],
// taken[capacity] (bytes), free_slots[capacity] (int32).
__global__ void __launch_bounds__(kThreads)
    CompactSlotUpdateKernel(const CompactSlotUpdateParams p) {
  extern __shared__ int32_t shared[];
  __shared__ int warp_sums[kWarps];
  int32_t* free_slots = shared;                                         // [capacity]
  uint8_t* kept = reinterpret_cast<uint8_t*>(free_slots + p.capacity);  // [capacity]
  uint8_t* taken = kept + p.capacity;                                   // [capacity]
  const int64_t pairs = static_cast<int64_t>(p.batch) * p.num_kv_heads;
  const int64_t map_stride = 1 + static_cast<int64_t>(p.capacity);
  for (int64_t pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
    const int sequence = static_cast<int>(pair / p.num_kv_heads);
    const int kv_head = static_cast<int>(pair % p.num_kv_heads);
    const int map_id = p.map_index[sequence];
    if (map_id < 0 || map_id >= p.num_maps) continue;  // uniform over the block
    int32_t* map = p.maps + (static_cast<int64_t>(map_id) * p.num_kv_heads + kv_head) * map_stride;
    const int sink = min(max(p.sink_end[sequence], 0), p.max_sink_tokens);
    const int chosen = min(max(p.selected_count[pair], 0), p.budget);
    const int32_t* selected_row = p.selected + pair * p.budget;
    const int count = sink + chosen;
    const bool reset = p.reset != nullptr && p.reset[sequence] != 0;
    const int old_count = reset ? 0 : min(max(map[0], 0), p.capacity);
    for (int i = threadIdx.x; i < count; i += kThreads) {
      kept[i] = 0;
      taken[i] = 0;
    }
    __syncthreads();
    // Kept: an old slot below the new count whose position is selected again (binary search:
    // the selection is ascending).
    for (int s = threadIdx.x; s < min(count, old_count); s += kThreads) {
      const int32_t position = map[1 + s];
      int lo = 0, hi = count;  // first index whose position >= `position`
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (SelectionAt(selected_row, sink, mid) < position) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      if (lo < count && SelectionAt(selected_row, sink, lo) == position) {
        kept[lo] = 1;
        taken[s] = 1;
      }
    }
    __syncthreads();
    // Rank the free slots: free_slots[r] is the r-th slot below count not taken.
    int carry = 0;
    for (int base = 0; base < count; base += kThreads) {
      const int s = base + threadIdx.x;
      const int flag = s < count && taken[s] == 0 ? 1 : 0;
      int total = 0;
      const int rank = carry + BlockExclusiveSum(flag, warp_sums, total);
      if (flag != 0) free_slots[rank] = s;
      carry += total;
    }
    __syncthreads();
    // The r-th entering row (ascending by position) takes free_slots[r].
    int32_t* slots_out = p.entering_slots + pair * p.capacity;
    int32_t* positions_out = p.entering_positions + pair * p.capacity;
    carry = 0;
    for (int base = 0; base < count; base += kThreads) {
      const int i = base + threadIdx.x;
      const int flag = i < count && kept[i] == 0 ? 1 : 0;
      int total = 0;
      const int rank = carry + BlockExclusiveSum(flag, warp_sums, total);
      if (flag != 0) {
        const int32_t slot = free_slots[rank];
        const int32_t position = SelectionAt(selected_row, sink, i);
        slots_out[rank] = slot;
        positions_out[rank] = position;
        map[1 + slot] = position;  // a free slot's old position was read by no other thread
      }
      carry += total;
    }
    for (int r = carry + threadIdx.x; r < p.capacity; r += kThreads) {
      slots_out[r] = -1;
      positions_out[r] = -1;
    }
    if (threadIdx.x == 0) {
      map[0] = count;
      p.counts[pair] = count;
      p.entering[pair] = carry;
    }
    __syncthreads();  // the shared flags are reused by the next pair
  }
}

Status Validate(const CompactSlotUpdateParams& p);

}  // namespace

// ---- launcher ---------------------------------------------------------------------------------

Status CompactSlotUpdate(const CompactSlotUpdateParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.batch == 0) return Status::Ok();
  const int64_t pairs = static_cast<int64_t>(params.batch) * params.num_kv_heads;
  const size_t shared = static_cast<size_t>(params.capacity) * (sizeof(int32_t) + 2);
  CompactSlotUpdateKernel<<<static_cast<unsigned>(std::min<int64_t>(pairs, kMaxGridY)), kThreads,
                            shared, stream>>>(params);
  return LaunchStatus("compact_slot_update");
}

// ---- validation -------------------------------------------------------------------------------

namespace {

Status Validate(const CompactSlotUpdateParams& p) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("CompactSlotUpdate: " + what);
  };
  if (p.batch < 0) return invalid("batch = " + std::to_string(p.batch) + " must be >= 0");
  if (p.num_kv_heads < 1) {
    return invalid("num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be >= 1");
  }
  if (p.max_sink_tokens < 0 || p.budget < 0) {
    return invalid("max_sink_tokens = " + std::to_string(p.max_sink_tokens) +
                   " and budget = " + std::to_string(p.budget) + " must be >= 0");
  }
  if (p.capacity < 1 || p.capacity < p.max_sink_tokens + p.budget ||
      p.capacity > kMaxCompactSlots) {
    return invalid(
        "capacity = " + std::to_string(p.capacity) +
        " must hold max_sink_tokens + budget = " + std::to_string(p.max_sink_tokens + p.budget) +
        " and be in [1, " + std::to_string(kMaxCompactSlots) + "]");
  }
  if (p.batch == 0) return Status::Ok();
  if (p.num_maps < 1) return invalid("num_maps = " + std::to_string(p.num_maps) + " must be >= 1");
  if (p.maps == nullptr) return invalid("maps is null");
  if (p.map_index == nullptr) return invalid("map_index is null");
  if (p.sink_end == nullptr) return invalid("sink_end is null");
  if (p.selected_count == nullptr) return invalid("selected_count is null");
  if (p.selected == nullptr && p.budget > 0) return invalid("selected is null");
  if (p.counts == nullptr) return invalid("counts is null");
  if (p.entering == nullptr) return invalid("entering is null");
  if (p.entering_slots == nullptr) return invalid("entering_slots is null");
  if (p.entering_positions == nullptr) return invalid("entering_positions is null");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
