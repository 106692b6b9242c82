// The split_by_head residency's device storage on the CUDA model (docs/synckv.md "On the
// GPU"), for up to `slots` requests at once, allocated whole at Attach (before the engine sizes
// its paged KV pool from what is left), so the GPU holds only:
//   * the R-heads' full KV: per (layer, cluster) a pool [slots * blocks_per_slot][1][64][head_dim]
//     (K and V, bf16), slot s owning blocks [s * blocks_per_slot, + blocks_per_slot): a paged
//     pool of one KV head with a fixed block table per slot, read by the dense decode kernels;
//   * the NR-heads' compact pool: per layer [slots][kv_heads][pool_capacity][head_dim] (K and V,
//     bf16; the R-heads' rows unused), with its bookkeeping (head_pool.cuh HeadPoolBook);
//   * the paged cache's local window (the engine's), not here.
// The NR-heads' full KV (the store) is per layer [nr_heads][slots * context_capacity][head_dim]
// (K and V, bf16) in pinned host memory mapped into the device's address space, or on another
// GPU with peer access, chosen by HeadSplitStore; the device reads a fetch's rows from it
// directly (head_pool.cuh HeadPoolCopy) on a copy stream.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/attention/head_split.h"
#include "inference_rank/residency/residency_backend.h"
#include "inference_rank/residency/split_by_head/split_by_head_kv.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

class SplitByHeadDeviceKv {
 public:
  static constexpr int kRBlockTokens = 64;  // the R-heads' pool block

  // `context_capacity`: positions a request may reach (rounded up to kRBlockTokens);
  // `pool_capacity`: rows per NR-head (the policy's KeptPositions of the capacity). Every layer
  // must have the same number of clusters. ResourceExhausted naming the bytes when it does not
  // fit; InvalidArgument for a store device that cannot be reached by peer access.
  static Result<std::unique_ptr<SplitByHeadDeviceKv>> Create(const HeadSplit& split,
                                                             const ModelConfig& model, int device,
                                                             int slots, int context_capacity,
                                                             int pool_capacity,
                                                             const HeadSplitStore& store);
  ~SplitByHeadDeviceKv();  // waits for the copy stream

  int slots() const { return slots_; }
  int clusters() const { return clusters_; }
  int nr_heads() const { return nr_heads_; }
  int context_capacity() const { return context_capacity_; }
  int pool_capacity() const { return pool_capacity_; }
  int blocks_per_slot() const { return context_capacity_ / kRBlockTokens; }
  int head_dim() const { return head_dim_; }
  const HeadSplit& split() const { return split_; }
  const HeadSplitStore& store() const { return store_; }

  // A free slot, or -1; Release gives it back.
  int AcquireSlot();
  void ReleaseSlot(int slot);

  __nv_bfloat16* r_keys(int layer, int cluster) { return RPool(r_keys_, layer, cluster); }
  __nv_bfloat16* r_values(int layer, int cluster) { return RPool(r_values_, layer, cluster); }
  int64_t r_pool_blocks() const { return static_cast<int64_t>(slots_) * blocks_per_slot(); }
  __nv_bfloat16* pool_keys(int layer) { return PoolOf(pool_keys_, layer); }
  __nv_bfloat16* pool_values(int layer) { return PoolOf(pool_values_, layer); }
  // Of NR index `nr` (store_index(layer)[kv_head]) in `layer`, row (slot * capacity + position).
  __nv_bfloat16* store_keys(int layer) { return store_keys_ + StoreLayer(layer); }
  __nv_bfloat16* store_values(int layer) { return store_values_ + StoreLayer(layer); }
  int64_t store_rows() const { return static_cast<int64_t>(slots_) * context_capacity_; }
  // The layer's book (head_pool.cuh HeadPoolBook fields) and head maps, device.
  int32_t* positions(int layer);
  int32_t* row_of(int layer);
  int32_t* sizes(int layer);
  int32_t* counts(int layer);
  const int32_t* cluster_of(int layer) const;   // [kv_heads]: a NR-head's cluster, -1 R-heads
  const int32_t* store_index(int layer) const;  // [kv_heads]: a NR-head's index in the store

  // Device bytes this object holds (the R-heads' pools, the compact pools, the books), and the
  // store's bytes (host or the other GPU).
  size_t device_bytes() const { return device_bytes_; }
  size_t store_bytes() const { return store_bytes_; }

  // The fetches' stream, and per layer the event a fetch of the layer records when it is done
  // (`fetch_pending`: recorded and not yet waited for), and the two timing events of the wait.
  cudaStream_t copy_stream() const { return copy_stream_; }
  cudaEvent_t fetch_done(int layer) const { return events_[static_cast<size_t>(layer) * 3]; }
  cudaEvent_t wait_begin(int layer) const { return events_[static_cast<size_t>(layer) * 3 + 1]; }
  cudaEvent_t wait_end(int layer) const { return events_[static_cast<size_t>(layer) * 3 + 2]; }
  std::vector<char>& fetch_pending() { return fetch_pending_; }
  std::vector<char>& waited() { return waited_; }  // [layer]: this step waited for a fetch
  // [2], device: rows fetched from the store, rows copied from the local recent positions.
  unsigned long long* copied_rows() { return copied_rows_.data(); }
  // The two counters' values; waits for the copy stream.
  Status ReadCopiedRows(unsigned long long out[2]);
  // The residency's counters (set by it; the backends add to them).
  SplitByHeadCounters* counters = nullptr;

 private:
  SplitByHeadDeviceKv() = default;
  __nv_bfloat16* RPool(cuda::DeviceBuffer<__nv_bfloat16>& pool, int layer, int cluster) {
    return pool.data() + (static_cast<size_t>(layer) * clusters_ + cluster) * r_pool_blocks() *
                             kRBlockTokens * head_dim_;
  }
  __nv_bfloat16* PoolOf(cuda::DeviceBuffer<__nv_bfloat16>& pool, int layer) {
    return pool.data() +
           static_cast<size_t>(layer) * slots_ * kv_heads_ * pool_capacity_ * head_dim_;
  }
  size_t StoreLayer(int layer) const {
    return static_cast<size_t>(layer) * nr_heads_ * store_rows() * head_dim_;
  }

  HeadSplit split_;
  HeadSplitStore store_;
  int device_ = 0;
  int layers_ = 0, kv_heads_ = 0, head_dim_ = 0, clusters_ = 0, nr_heads_ = 0;
  int slots_ = 0, context_capacity_ = 0, pool_capacity_ = 0;
  std::vector<int> free_slots_;
  cuda::DeviceBuffer<__nv_bfloat16> r_keys_, r_values_;        // [layer][cluster][blocks][64][d]
  cuda::DeviceBuffer<__nv_bfloat16> pool_keys_, pool_values_;  // [layer][slot][kv_head][rows][d]
  cuda::DeviceBuffer<int32_t> positions_;  // [layer][slot][cluster][pool_capacity]
  cuda::DeviceBuffer<int32_t> row_of_;     // [layer][slot][cluster][context_capacity]
  cuda::DeviceBuffer<int32_t> sizes_;      // [layer][slot][cluster][2]
  cuda::DeviceBuffer<int32_t> counts_;     // [layer][slot][kv_head]
  cuda::DeviceBuffer<int32_t> head_maps_;  // [layer][2][kv_head]: cluster_of, store_index
  cuda::DeviceBuffer<unsigned long long> copied_rows_;  // [2]
  __nv_bfloat16* store_keys_ = nullptr;  // [layer][nr][slots * context_capacity][head_dim]
  __nv_bfloat16* store_values_ = nullptr;
  size_t device_bytes_ = 0, store_bytes_ = 0;
  cudaStream_t copy_stream_ = nullptr;
  std::vector<cudaEvent_t> events_;  // [layer][fetch_done, wait_begin, wait_end]
  std::vector<char> fetch_pending_;  // [layer]
  std::vector<char> waited_;         // [layer]
};

// One request's place in the device storage and the host's copy of its schedule, which the
// policy's backend half keeps (it decides the sets; their sizes follow from the budget, so the
// host knows every count without reading the device).
struct SplitByHeadCudaRequest {
  SplitByHeadDeviceKv* kv = nullptr;
  int slot = -1;
  bool installed = false;  // the prompt's selection was made
  int static_rows = 0;     // S
  int dynamic_rows = 0;    // D attended now
  int recent_begin = 0;    // the NR-heads read positions [recent_begin, p] in place
  bool pending = false;    // an anticipation's rows arrive for the next step
  int selected_at = 0;
  int pending_dynamic_rows = 0;

  // A decode step at `position`: a pending anticipation made at an earlier step is now attended.
  void BeginStep(int position) {
    if (!pending || position <= selected_at) return;
    dynamic_rows = pending_dynamic_rows;
    recent_begin = selected_at + 1;
    pending = false;
  }
};

// The handle on a request's forward entries on the CUDA model (ForwardEntry::residency).
struct SplitByHeadCudaEntry final : public ResidencyEntry {
  SplitByHeadCudaRequest* request = nullptr;
};

}  // namespace rubato
