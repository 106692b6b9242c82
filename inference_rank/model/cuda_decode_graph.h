// CUDA graphs for decode steps: a decode step launches a few hundred small kernels, and
// replaying them as one captured graph removes the per-launch CPU cost that otherwise dominates
// small batches. A graph is valid for one launch shape and one set of device addresses, so it is
// keyed by everything the captured launches bake in (DecodeGraphKey); per-step inputs are read
// from fixed device buffers that the step's host-to-device copy rewrites. A key seen for the
// first time runs eagerly, the second time it is captured, then replayed. The owner calls Clear()
// whenever a buffer that captured launches point to is reallocated. docs/cuda_model.md.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <compare>
#include <cstdint>
#include <functional>
#include <map>

#include "common/status.h"

namespace rubato {

struct DecodeGraphKey {
  int batch = 0;
  int max_seq_len = 0;   // decode attention bucket
  int table_stride = 0;  // decode block-table row length
  int sample_rows = 0;
  int host_rows = 0;
  int sink_tokens = 0;
  int recent_tokens = 0;
  const void* key_pool = nullptr;  // the KV cache's pools (a graph holds their addresses)
  const void* value_pool = nullptr;
  int num_blocks = 0;           // layer stride of the pools
  int backend_rows = 0;         // decode rows [0, backend_rows) the attention backend attends
  bool adjusts_logits = false;  // the logit-adjustment launch before the sampler
  // What the attention backend's launches bake in beyond the fields above (its row counts, grid
  // bounds, buffer addresses, modes: CudaAttentionBackend::AddToGraphKey); zero when it adds
  // nothing.
  std::array<int64_t, 8> policy{};

  auto operator<=>(const DecodeGraphKey&) const = default;
};

class DecodeGraphCache {
 public:
  // Keeps at most `max_graphs` graphs, dropping the least recently used.
  explicit DecodeGraphCache(int max_graphs = 32) : max_graphs_(max_graphs) {}
  ~DecodeGraphCache() { Clear(); }
  DecodeGraphCache(const DecodeGraphCache&) = delete;
  DecodeGraphCache& operator=(const DecodeGraphCache&) = delete;

  // Runs the device work of `key` on `stream` (see the file comment). `enqueue` launches that
  // work on the stream it is given, asynchronously. If capturing fails for a reason other than
  // `enqueue`'s own error, graphs are switched off with a warning and the work runs eagerly.
  Status Run(const DecodeGraphKey& key, cudaStream_t stream,
             const std::function<Status(cudaStream_t)>& enqueue);

  // Destroys every graph (buffers moved: their captured addresses are stale).
  void Clear();

  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }  // graph launches
  bool disabled() const { return disabled_; }

 private:
  struct Entry {
    cudaGraphExec_t exec = nullptr;  // null: seen once, not captured yet
    uint64_t last_use = 0;
  };

  Status Capture(Entry& entry, cudaStream_t stream,
                 const std::function<Status(cudaStream_t)>& enqueue);
  void DropLeastRecentlyUsed();

  int max_graphs_;
  std::map<DecodeGraphKey, Entry> graphs_;
  uint64_t clock_ = 0;
  int64_t captures_ = 0;
  int64_t replays_ = 0;
  bool disabled_ = false;
};

}  // namespace rubato
