// The split_by_head device pool's ops (head_pool.cuh): kernels, launchers, validation.
#include <string>

#include "inference_rank/residency/split_by_head/kernels/head_pool.cuh"
#include "kernels/cuda/cuda_status.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Exclusive prefix of a 0/1 flag over the block's threads (in thread order) and the block's
// total. `shared` holds kWarps + 1 ints.
__device__ int FlagPrefix(bool flag, int* shared, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  __syncthreads();  // `shared` may still be read by the previous call
  if (lane == 0) shared[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += shared[w];
    sum += shared[w];
  }
  *total = sum;
  return before + in_warp;
}

__device__ bool Contains(const int32_t* list, int count, int position) {
  int low = 0, high = count;
  while (low < high) {
    const int mid = (low + high) / 2;
    if (list[mid] < position) {
      low = mid + 1;
    } else {
      high = mid;
    }
  }
  return low < count && list[low] == position;
}

// One block per (row, cluster).
__global__ void HeadPoolUpdateKernel(HeadPoolUpdateParams p) {
  __shared__ int shared[kWarps + 1];
  const HeadPoolBook& b = p.book;
  const int row = blockIdx.x / b.clusters, cluster = blockIdx.x % b.clusters;
  const int slot = p.slot[row];
  if (slot < 0 || slot >= b.slots) return;
  const int64_t book = static_cast<int64_t>(slot) * b.clusters + cluster;
  int32_t* positions = b.positions + book * b.pool_capacity;
  int32_t* row_of = b.row_of + book * b.context_capacity;
  int32_t* sizes = b.sizes + book * 2;
  const int64_t pair = static_cast<int64_t>(row) * b.clusters + cluster;
  const int32_t* selected = p.selected + pair * p.selected_stride;
  const int n = min(max(p.selected_count[pair], 0), p.selected_stride);
  int32_t* moves_row = p.move_rows + pair * b.pool_capacity;
  int32_t* moves_position = p.move_positions + pair * b.pool_capacity;
  int statics = 0, dynamics = 0, moves = 0;
  if (p.install) {
    for (int i = threadIdx.x; i < b.context_capacity; i += kThreads) row_of[i] = -1;
    __syncthreads();
    const int32_t* fixed = p.static_selected + pair * p.selected_stride;
    const int s = min(min(max(p.static_count[pair], 0), p.selected_stride), b.pool_capacity);
    const int d = min(n, b.pool_capacity - s);
    for (int i = threadIdx.x; i < s + d; i += kThreads) {
      const int position = i < s ? fixed[i] : selected[i - s];
      positions[i] = position;
      moves_row[i] = i;
      moves_position[i] = position;
      if (position >= 0 && position < b.context_capacity) row_of[position] = i;
    }
    statics = s, dynamics = d, moves = s + d;
  } else {
    statics = sizes[0];
    const int old = sizes[1];
    int32_t* freed = p.scratch + pair * b.pool_capacity;
    // 1. Counts: the old dynamic rows not selected again (freed, listed in row order) and the
    //    selected positions not in the pool (new); nothing written to the book yet.
    int free_total = 0;
    for (int base = 0; base < old; base += kThreads) {
      const int j = statics + base + threadIdx.x;
      const bool flag = base + threadIdx.x < old && !Contains(selected, n, positions[j]);
      int chunk = 0;
      const int rank = free_total + FlagPrefix(flag, shared, &chunk);
      if (flag) freed[rank] = j;
      free_total += chunk;
    }
    int new_total = 0;
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + threadIdx.x;
      bool flag = false;
      if (i < n) {
        const int position = selected[i];
        flag = position >= 0 && position < b.context_capacity && row_of[position] < 0;
      }
      int chunk = 0;
      FlagPrefix(flag, shared, &chunk);
      new_total += chunk;
    }
    __syncthreads();
    // 2. Free as many old rows as new positions arrive, then place the new positions.
    const int free_used = min(free_total, new_total);
    for (int r = threadIdx.x; r < free_used; r += kThreads) {
      const int position = positions[freed[r]];
      if (position >= 0 && position < b.context_capacity) row_of[position] = -1;
    }
    __syncthreads();
    int placed = 0;
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + threadIdx.x;
      const int position = i < n ? selected[i] : -1;
      // Freed positions are not selected, so no thread of this loop reads a row_of another writes.
      const bool flag =
          i < n && position >= 0 && position < b.context_capacity && row_of[position] < 0;
      int chunk = 0;
      const int rank = placed + FlagPrefix(flag, shared, &chunk);
      if (flag) {
        const int target = rank < free_used ? freed[rank] : statics + old + (rank - free_used);
        if (target < b.pool_capacity) {
          positions[target] = position;
          row_of[position] = target;
          moves_row[rank] = target;
          moves_position[rank] = position;
        } else {
          moves_row[rank] = -1;  // no room (a caller bug): the move is skipped
          moves_position[rank] = position;
        }
      }
      placed += chunk;
    }
    dynamics = min(old + new_total - free_used, b.pool_capacity - statics);
    moves = new_total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sizes[0] = statics;
    sizes[1] = dynamics;
    p.move_count[pair] = moves;
  }
  for (int h = threadIdx.x; h < b.kv_heads; h += kThreads) {
    if (b.cluster_of[h] == cluster)
      b.counts[static_cast<int64_t>(slot) * b.kv_heads + h] = statics + dynamics;
  }
}

// kCopyBlocks blocks per (row, cluster) (blockIdx.y); their threads walk (move, 16-byte
// vector) for each NR-head of the cluster: enough loads in flight to keep a fetch over PCIe or
// NVLink busy (one block alone is latency-bound), while a short move list leaves most blocks
// idle at once.
constexpr int kCopyBlocks = 32;

__global__ void HeadPoolCopyKernel(HeadPoolCopyParams p) {
  const int row = blockIdx.x / p.clusters, cluster = blockIdx.x % p.clusters;
  if (p.delay_ns > 0 && threadIdx.x == 0) {
    for (unsigned int slept = 0; slept < p.delay_ns; slept += 1000) __nanosleep(1000);
  }
  __syncthreads();
  const int slot = p.slot[row];
  const int64_t pair = static_cast<int64_t>(row) * p.clusters + cluster;
  const int moves = min(max(p.move_count[pair], 0), p.move_stride);
  const int vectors = p.head_dim / 8;
  const int local_from = p.local_from[row];
  unsigned long long copied = 0;
  for (int h = 0; h < p.kv_heads; ++h) {
    if (p.cluster_of[h] != cluster) continue;
    const int64_t pool_head =
        (static_cast<int64_t>(slot) * p.kv_heads + h) * p.pool_capacity * p.head_dim;
    for (int64_t work = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
         work < static_cast<int64_t>(moves) * vectors;
         work += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      const int m = static_cast<int>(work / vectors), v = static_cast<int>(work % vectors);
      const int target = p.move_rows[pair * p.move_stride + m];
      const int position = p.move_positions[pair * p.move_stride + m];
      const bool local = position >= local_from;
      if (target < 0 || position < 0 || local != (p.source == HeadPoolSource::kLocal)) continue;
      const uint4* key;
      const uint4* value;
      if (local) {
        const int32_t block =
            p.block_tables[static_cast<int64_t>(p.table_index[row]) * p.block_table_stride +
                           position / p.block_tokens];
        const int64_t at = ((static_cast<int64_t>(block) * p.kv_heads + h) * p.block_tokens +
                            position % p.block_tokens) *
                           p.head_dim;
        key = reinterpret_cast<const uint4*>(p.key_pool + at) + v;
        value = reinterpret_cast<const uint4*>(p.value_pool + at) + v;
      } else {
        if (position >= p.context_capacity) continue;
        const int64_t at = (p.store_index[h] * p.store_rows +
                            static_cast<int64_t>(slot) * p.context_capacity + position) *
                           p.head_dim;
        key = reinterpret_cast<const uint4*>(p.store_keys + at) + v;
        value = reinterpret_cast<const uint4*>(p.store_values + at) + v;
      }
      const int64_t to = pool_head + static_cast<int64_t>(target) * p.head_dim;
      reinterpret_cast<uint4*>(p.pool_keys + to)[v] = *key;
      reinterpret_cast<uint4*>(p.pool_values + to)[v] = *value;
      if (v == 0) ++copied;
    }
  }
  if (p.copied_rows != nullptr && copied > 0) atomicAdd(p.copied_rows, copied);
}

Status ValidateBook(const HeadPoolBook& b, const std::string& op) {
  if (b.positions == nullptr || b.row_of == nullptr || b.sizes == nullptr || b.counts == nullptr ||
      b.cluster_of == nullptr) {
    return InvalidArgumentError(op + "the book's arrays are required");
  }
  if (b.slots < 1 || b.clusters < 1 || b.kv_heads < 1 || b.pool_capacity < 1 ||
      b.context_capacity < 1) {
    return InvalidArgumentError(op +
                                "slots, clusters, kv_heads, pool_capacity and "
                                "context_capacity must be >= 1");
  }
  return Status::Ok();
}

}  // namespace

Status HeadPoolUpdate(const HeadPoolUpdateParams& p, cudaStream_t stream) {
  const std::string op = "HeadPoolUpdate: ";
  if (p.rows < 0) return InvalidArgumentError(op + "rows " + std::to_string(p.rows) + " < 0");
  if (p.rows == 0) return Status::Ok();
  RUBATO_RETURN_IF_ERROR(ValidateBook(p.book, op));
  if (p.slot == nullptr || p.selected == nullptr || p.selected_count == nullptr ||
      p.move_rows == nullptr || p.move_positions == nullptr || p.move_count == nullptr) {
    return InvalidArgumentError(op + "slot, selected, selected_count and the moves are required");
  }
  if (p.selected_stride < 1) {
    return InvalidArgumentError(op + "selected_stride " + std::to_string(p.selected_stride) +
                                " < 1");
  }
  if (p.install && (p.static_selected == nullptr || p.static_count == nullptr)) {
    return InvalidArgumentError(op + "an install needs static_selected and static_count");
  }
  if (!p.install && p.scratch == nullptr) {
    return InvalidArgumentError(op + "an anticipation needs the scratch");
  }
  HeadPoolUpdateKernel<<<p.rows * p.book.clusters, kThreads, 0, stream>>>(p);
  return LaunchStatus("head_pool_update");
}

Status HeadPoolCopy(const HeadPoolCopyParams& p, cudaStream_t stream) {
  const std::string op = "HeadPoolCopy: ";
  if (p.rows < 0) return InvalidArgumentError(op + "rows " + std::to_string(p.rows) + " < 0");
  if (p.rows == 0) return Status::Ok();
  if (p.clusters < 1 || p.kv_heads < 1 || p.head_dim <= 0 || p.head_dim % 8 != 0 ||
      p.pool_capacity < 1 || p.move_stride < 1) {
    return InvalidArgumentError(op +
                                "clusters, kv_heads, pool_capacity, move_stride >= 1 and "
                                "head_dim a positive multiple of 8 are required");
  }
  if (p.cluster_of == nullptr || p.slot == nullptr || p.move_rows == nullptr ||
      p.move_positions == nullptr || p.move_count == nullptr || p.local_from == nullptr ||
      p.pool_keys == nullptr || p.pool_values == nullptr) {
    return InvalidArgumentError(op +
                                "cluster_of, slot, the moves, local_from and the pools are "
                                "required");
  }
  if (p.source == HeadPoolSource::kLocal &&
      (p.key_pool == nullptr || p.value_pool == nullptr || p.block_tables == nullptr ||
       p.table_index == nullptr || p.block_tokens < 1)) {
    return InvalidArgumentError(op + "a local copy needs the paged pools and block tables");
  }
  if (p.source == HeadPoolSource::kStore &&
      (p.store_keys == nullptr || p.store_values == nullptr || p.store_index == nullptr ||
       p.context_capacity < 1 || p.store_rows < p.context_capacity)) {
    return InvalidArgumentError(op + "a fetch needs the store, store_index and its shape");
  }
  HeadPoolCopyKernel<<<dim3(p.rows * p.clusters, kCopyBlocks), kThreads, 0, stream>>>(p);
  return LaunchStatus("head_pool_copy");
}

}  // namespace rubato::cuda
