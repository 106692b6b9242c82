// SFI's per-request compact buffers on the GPU: one pool, a slot per request holding a
// selection, found by a per-row slot id in the step inputs (one launch serves any mix; graphs
// stay valid while requests come and go). Layer-major arrays; slots handed out as handles whose
// destructor gives them back (docs/sfi.md "SFI compact pool"). With the fidelity guard on, each
// slot also holds its reference queries and its step's cosine sum (docs/fidelity.md).
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "inference_rank/policies/sfi/sfi_state.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

struct CudaSfiPoolShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int capacity = 0;  // rows per (slot, layer, KV head): sink_tokens + budget
  int slots = 0;     // requests holding a selection at once
  // num_heads * head_dim with policy.fidelity_guard > 0, else 0 (no guard arrays).
  int guard_query_dim = 0;

  size_t Bytes() const;  // every array
};

class CudaSfiPool {
 public:
  // Allocates the arrays on the current device (uninitialized: a slot is written by its
  // owner's first slow step before anything reads it). ResourceExhausted naming the bytes.
  static Result<std::unique_ptr<CudaSfiPool>> Create(const CudaSfiPoolShape& shape);

  ~CudaSfiPool();
  CudaSfiPool(const CudaSfiPool&) = delete;
  CudaSfiPool& operator=(const CudaSfiPool&) = delete;

  const CudaSfiPoolShape& shape() const { return shape_; }

  // The slot `state` holds in this pool, or -1 when its handle is not one of this pool's (none,
  // or another model's).
  int SlotOf(const SfiSequenceState& state) const;
  // The slot of `state`, giving it a free one (replacing a handle of another pool) when it
  // holds none of this pool's. ResourceExhausted when every slot is held.
  Result<int> AcquireFor(SfiSequenceState& state);
  int slots_in_use() const;

  // One layer's arrays (see the file comment): [slot][kv_head][capacity][head_dim] bf16,
  // [slot][kv_head] int32 and [slot][kv_head][capacity] int32.
  __nv_bfloat16* layer_keys(int layer) { return keys_.data() + layer * LayerRows() * head_dim(); }
  __nv_bfloat16* layer_values(int layer) {
    return values_.data() + layer * LayerRows() * head_dim();
  }
  int32_t* layer_counts(int layer) {
    return counts_.data() + static_cast<size_t>(layer) * shape_.slots * shape_.num_kv_heads;
  }
  int32_t* layer_positions(int layer) { return positions_.data() + layer * LayerRows(); }
  // Every layer's counts, [layer][slot][kv_head] int32 (one copy back after a slow step).
  const cuda::DeviceBuffer<int32_t>& counts() const { return counts_; }
  const cuda::DeviceBuffer<int32_t>& positions() const { return positions_; }
  // The fidelity guard (guard_query_dim > 0; empty otherwise): one layer's reference queries,
  // [slot][guard_query_dim] f32, and every slot's cosine sum over the layers of its last fast
  // step, [slot] f32 (one copy back after a fast step).
  float* layer_guard_references(int layer) {
    return guard_references_.data() +
           static_cast<size_t>(layer) * shape_.slots * static_cast<size_t>(shape_.guard_query_dim);
  }
  float* guard_cosine_sums() { return guard_cosine_sums_.data(); }
  const cuda::DeviceBuffer<float>& guard_cosine_sums_buffer() const { return guard_cosine_sums_; }

 private:
  class FreeList;  // the free slots, shared with the handles (cuda_sfi_pool.cc)
  class Handle;    // SfiBackendHandle: one held slot

  explicit CudaSfiPool(const CudaSfiPoolShape& shape);
  size_t LayerRows() const {  // rows of one layer: slots x kv_heads x capacity
    return static_cast<size_t>(shape_.slots) * shape_.num_kv_heads * shape_.capacity;
  }
  size_t head_dim() const { return static_cast<size_t>(shape_.head_dim); }

  CudaSfiPoolShape shape_;
  std::shared_ptr<FreeList> free_list_;
  cuda::DeviceBuffer<__nv_bfloat16> keys_;    // [layer][slot][kv_head][capacity][head_dim]
  cuda::DeviceBuffer<__nv_bfloat16> values_;  // [layer][slot][kv_head][capacity][head_dim]
  cuda::DeviceBuffer<int32_t> counts_;        // [layer][slot][kv_head]
  cuda::DeviceBuffer<int32_t> positions_;     // [layer][slot][kv_head][capacity]
  // The fidelity guard's: RoPE taken out, written at the slot's slow steps.
  cuda::DeviceBuffer<float> guard_references_;   // [layer][slot][num_heads][head_dim] f32
  cuda::DeviceBuffer<float> guard_cosine_sums_;  // [slot] f32, summed over the layers
};

}  // namespace rubato
