// The GPU cache rank's KV store's private pieces, shared by its two sources
// (device_kv_store.cc: pools, sessions, workspaces; device_kv_store_step.cc: the step and its
// ops): the device pools, a session, and the step tables with their layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache_rank/device/device_kv_store.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

// The K and V pools behind the PagedKvCache: [layer][block][kv_head][block_tokens][head_dim].
class DeviceKvStore::Pools : public KvStorage {
 public:
  size_t bytes() const override { return keys.bytes() + values.bytes(); }
  size_t layer_elements = 0;  // blocks x kv_heads x block_tokens x head_dim
  cuda::DeviceBuffer<__nv_bfloat16> keys;
  cuda::DeviceBuffer<__nv_bfloat16> values;
};

struct DeviceKvStore::Session {
  uint64_t request_id = 0;
  uint32_t capacity_tokens = 0;
  uint32_t length = 0;      // positions written (steps begun)
  int delta_map = -1;       // its slot maps' index (SelectTopKDelta), -1: none
  bool delta_fresh = true;  // no step yet: the peer's pools are empty
  KvSequence sequence;      // the blocks of the whole capacity
};

// Byte offsets of the step tables' sections; the block tables come last so that the others do
// not move when a longer session widens them.
struct TablesLayout {
  size_t key_offsets = 0;    // int64 [max_rows], elements from the append source
  size_t value_offsets = 0;  // int64 [max_rows]
  size_t head_strides = 0;   // int32 [max_rows]
  size_t slots = 0;          // int32 [max_rows]
  size_t seq_lens = 0;       // int32 [max_batch]: L after the step
  size_t sink_end = 0;       // int32 [max_batch]
  size_t begin = 0;          // int32 [max_batch]: first candidate (= sink_end)
  size_t count = 0;          // int32 [max_batch]: candidates, recent_begin - sink_end
  size_t row_k = 0;          // int32 [max_batch]: top_k
  size_t map_index = 0;      // int32 [max_batch]: the session's slot maps (-1: none)
  size_t reset = 0;          // int32 [max_batch]: 1, the deltas are full replies
  size_t zeros = 0;          // int32 [max_batch]: 0 (no sink rows in a delta gather)
  size_t block_tables = 0;   // int32 [batch][stride], the step's stride
  size_t total = 0;          // with max_batch x max_stride block tables
};

inline TablesLayout LayoutTables(int max_batch, int max_rows, int max_stride) {
  TablesLayout t;
  size_t at = 0;
  const auto take = [&](size_t& field, size_t bytes) {
    field = at;
    at += (bytes + 15) / 16 * 16;
  };
  const size_t rows = static_cast<size_t>(max_rows), batch = static_cast<size_t>(max_batch);
  take(t.key_offsets, rows * sizeof(int64_t));
  take(t.value_offsets, rows * sizeof(int64_t));
  take(t.head_strides, rows * sizeof(int32_t));
  take(t.slots, rows * sizeof(int32_t));
  for (size_t* field :
       {&t.seq_lens, &t.sink_end, &t.begin, &t.count, &t.row_k, &t.map_index, &t.reset, &t.zeros}) {
    take(*field, batch * sizeof(int32_t));
  }
  take(t.block_tables, batch * static_cast<size_t>(max_stride) * sizeof(int32_t));
  t.total = at;
  return t;
}

// The step in progress, planned on the host, and the buffers its tables travel through: two
// pinned staging slots used in turn (each refilled only after its last upload ran), one device
// copy read by the ops.
struct DeviceKvStore::StepTables {
  ~StepTables() {
    for (int s = 0; s < 2; ++s) {
      if (staging[s] != nullptr) cudaFreeHost(staging[s]);
      if (uploaded[s] != nullptr) cudaEventDestroy(uploaded[s]);
    }
  }
  TablesLayout layout;
  int max_stride = 0;
  std::byte* staging[2] = {nullptr, nullptr};  // pinned, layout.total bytes each
  cudaEvent_t uploaded[2] = {nullptr, nullptr};
  int next_slot = 0;
  cuda::DeviceBuffer<std::byte> device;  // layout.total bytes

  // The plan of the step in progress.
  bool active = false;
  std::vector<uint64_t> session_ids;  // [batch]
  int batch = 0;
  int rows = 0;
  int stride = 0;                 // block table entries per entry this step
  int max_len = 0;                // largest L
  int max_sink_end = 0;           // largest sink_end
  int max_top_k = 0;              // largest top_k
  int max_candidates = 0;         // largest recent_begin - sink_end
  std::vector<uint8_t> appended;  // [num_layers]: 1 once AppendLayer ran this step

  template <typename T>
  const T* Device(size_t offset) const {
    return reinterpret_cast<const T*>(device.data() + offset);
  }
};

}  // namespace rubato
