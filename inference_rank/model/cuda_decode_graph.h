// CUDA graphs for decode steps. A decode step launches a few hundred small kernels (about a
// dozen per layer); replaying them as one captured graph removes the per-launch CPU cost that
// otherwise dominates small batches. A graph is valid for one launch shape and one set of device
// addresses, so it is keyed by everything the captured launches bake in: batch size, decode
// attention bucket (max_seq_len) and block-table stride, sampled and host logit rows, the
// attention window, the KV pools, and SFI's row groups, recent-segment bucket, compact pool and
// Selector config. Inputs that change every step (token ids, positions, KV slots, block tables,
// lengths, sampling rows, SFI slots, anchors and J bounds) are read from fixed device buffers
// that the step's host-to-device copy rewrites before the launch.
//
// A step with SFI slow rows forks its maintenance onto a second stream and joins it back
// (cuda_sfi_ring.h); the capture records that as parallel branches, and graphs are
// instantiated with per-node priorities so that the branches keep their streams' priorities.
//
// A key seen for the first time runs eagerly (which also warms lazy state: cuBLASLt's algorithm
// choice per shape, kernel attributes); the second time it is captured, then replayed. The
// owner calls Clear() whenever a buffer that captured launches point to is reallocated.
#pragma once

#include <cuda_runtime_api.h>

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
  int num_blocks = 0;  // layer stride of the pools
  int sfi_fast_rows = 0;
  int sfi_slow_rows = 0;
  int sfi_recent_bucket = 0;         // two-segment grid bound
  const void* sfi_pool = nullptr;    // the SFI compact pool (its counts array)
  const void* sfi_config = nullptr;  // the SfiPolicyConfig the launches bake in

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
  void EvictLeastRecentlyUsed();

  int max_graphs_;
  std::map<DecodeGraphKey, Entry> graphs_;
  uint64_t clock_ = 0;
  int64_t captures_ = 0;
  int64_t replays_ = 0;
  bool disabled_ = false;
};

}  // namespace rubato
