// oracle_topk over a GPU cache rank inside this process, with delta replies (the colocated
// GpuCacheResidency with a policy whose cache-rank selector is oracle_topk; dense attention there
// is gpu_cache_attention.h). The offloaded requests' KV lives in a DeviceKvStore on the cache
// GPU; in every layer the step's q|k|v rows cross to it, are appended, and the cache GPU selects
// (SelectTopKDelta: scores, pooled top-k, slot maps, gather of only the rows entering each
// selection); the model's stream then scatters those rows, read in place from the cache GPU over
// peer access, into the persistent compact pools on the model GPU (DeviceCompactPools) and
// attends them with the recent window of its own paged cache (two-segment decode attention, as
// local oracle_topk does). Only stream waits on events order the two GPUs: no host
// synchronisation inside a step, and a decode step can be captured as a CUDA graph. Not
// thread-safe: the model's thread drives it. docs/disaggregated.md "oracle_topk on a GPU cache
// rank in this process". With `predict` (AsyncSpade, gpu_cache_topk_ahead.cc) each layer's
// selection is made one step ahead from a predicted query and scattered after the layer's
// attention on a side stream: docs/asyncspade.md "On a GPU cache rank".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache_rank/device/device_kv_store.h"
#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/model/cuda_pinned_buffer.h"
#include "inference_rank/residency/offloaded/device_compact_pools.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

struct GpuCacheTopKOptions {
  int model_device = 0;     // the model's GPU: compact pools, recent window, attention
  int cache_device = 1;     // the store's GPU; may equal model_device (one GPU)
  int block_tokens = 16;    // the store's, 16 or 64
  size_t budget_bytes = 0;  // K + V bytes of the store (allocated at Create)
  int max_rows = 0;         // rows of one step (decode tokens + prefill chunk tokens), >= 1
  int max_requests = 0;     // requests open at once and entries of one step, >= 1
  int max_context = 0;      // positions one session may hold, >= 1
  // The selection (the oracle_topk cache selector's rule): sink rows, then the top_k of
  // [sink, L - recent_tokens) by the GQA-pooled softmax of the query; the recent window is read
  // in place from the model's paged cache.
  int top_k = 2048;
  int sink_tokens = 4;
  int recent_tokens = 256;
  // false: every step's reply is a full one (every selected row rewritten into slots 0..n-1),
  // for comparing bytes and time with deltas.
  bool delta_replies = true;
  // AsyncSpade: the cache GPU keeps each session's last W + 1 queries per layer and query head,
  // and once a session has run `dense_steps` decode steps after its prompt (at least one),
  // selects for the next step with the predicted query while the model attends the selection
  // made at the last step (docs/asyncspade.md "On a GPU cache rank").
  bool predict = false;
  int query_window = 16;       // W, in [1, cuda::kDeviceQueryWindowMax]
  double ridge_lambda = 1e-2;  // > 0
  int dense_steps = 0;         // >= 0: steps selected with the step's real query
};

// Bytes of one step (or their sums): q|k|v rows to the cache GPU, and the delta packs back
// (per entering row its K and V in bf16, slot and position; per entry and KV head the count),
// beside what full replies would have carried (per selected row K, V and position; the count).
struct GpuCacheTopKBytes {
  uint64_t out = 0;
  uint64_t back = 0;
  uint64_t full_back = 0;
  uint64_t rows_back = 0;  // entering rows
  uint64_t rows_full = 0;  // selected rows
};

class GpuCacheTopK {
 public:
  // Allocates the store and the delta pack on the cache device, the compact pools and step
  // inputs on the model device, and enables peer access between the two where possible.
  static Result<std::unique_ptr<GpuCacheTopK>> Create(const ModelConfig& config,
                                                      const GpuCacheTopKOptions& options);
  ~GpuCacheTopK();
  GpuCacheTopK(const GpuCacheTopK&) = delete;
  GpuCacheTopK& operator=(const GpuCacheTopK&) = delete;

  // A session for positions [0, capacity_tokens): the store's blocks of its whole capacity, a
  // slot map per layer and KV head, and a compact pool. ResourceExhausted names the budget or
  // max_requests. Its first step's replies are full ones.
  Result<int> OpenSession(uint64_t request_id, int capacity_tokens);
  // Only between steps.
  Status CloseSession(int session);
  // Benchmarks: positions [0, length) of the session taken as written (FillRandom's values).
  Status SetSessionLength(int session, int length);

  // One entry of a step: `tokens` rows from `first_row` of the model's q|k|v rows, positions
  // from `first_position`. Decode entries (one token, rows [0, decode entries) in order) are
  // attended; the others (prefill chunks, attended locally by the model) are appended only.
  struct Entry {
    int session = 0;
    int first_position = 0;
    int tokens = 1;
    int first_row = 0;
  };
  // Host, outside any capture: plans the step (decode entries first, entry i of them at row i)
  // and uploads its inputs on both GPUs; `main` waits for them. `max_seq_len`: the model's
  // graph-stable bound of the decode rows' keys (its decode attention bucket), 0: the rows'.
  Status PlanStep(std::span<const Entry> entries, int decode_entries, int rows, cudaStream_t main,
                  int max_seq_len);
  // Device, on `main` after the layer's q|k|v rows are final (after RoPE and the local append):
  // the rows to the cache GPU, append, selection and delta there, then on `main` the scatter of
  // the entering rows into the pools.
  Status Layer(int layer, const __nv_bfloat16* qkv, cudaStream_t main);
  // Device, on `main` right after the decode rows' attention of the layer (AttendDecodeRows): in
  // a step ahead, the layer's pack is scattered into the pools on a side stream once that
  // attention has read them, and the last layer joins the side stream (the exposed wait);
  // otherwise nothing.
  Status AfterAttention(int layer, cudaStream_t main);
  // Points the decode rows' attention (the model's dense launch of rows [0, decode entries)) at
  // the layer's compact pools and the recent window.
  void SetAttention(int layer, cuda::DecodeAttentionParams& params) const;
  // Host, after the step's device work synchronized: counts its bytes (one read of the layers'
  // counts) and marks its sessions' pools filled.
  Status FinishStep();
  // After a failed step: waits for the cache GPU's stream.
  void AbortStep();

  // The last finished step's bytes, and the sums over every finished step.
  const GpuCacheTopKBytes& last_step() const { return last_step_; }
  const GpuCacheTopKBytes& totals() const { return totals_; }
  uint64_t steps() const { return steps_; }
  // Whether the planned step runs ahead (a captured step bakes in which: the graph key), the
  // finished steps that did, and their summed exposed wait (timed when predicting).
  bool step_ahead() const { return ahead_; }
  uint64_t predicted_steps() const { return predicted_steps_; }
  double total_wait_ms() const { return wait_ms_total_; }
  const GpuCacheTopKOptions& options() const { return options_; }
  bool delta_replies() const { return options_.delta_replies; }
  // Between steps: false makes every later step's replies full ones (benchmarks compare both).
  void set_delta_replies(bool on) { options_.delta_replies = on; }
  void SetStepObserver(std::function<void(const GpuCacheTopKBytes&)> observer) {
    step_observer_ = std::move(observer);
  }
  // Exposed wait, as GpuCacheAttention's: timing events around each layer's wait on `main`.
  Status SetMeasureWaits(bool on);
  Result<double> LastStepWaitMs() const;

  // Benchmarks: the whole store random bf16 in [-1, 1], then waits for it.
  Status FillRandom(uint64_t seed);
  // Device bytes on the cache GPU (store, pack) and on the model GPU (pools, inputs).
  size_t cache_device_bytes() const;
  size_t model_device_bytes() const;

 private:
  GpuCacheTopK() = default;
  struct Session {
    bool open = false;
    uint64_t store_session = 0;
    int pool = -1;
    bool filled = false;   // a step of it finished: its pools hold its slot maps' rows
    bool fresh = true;     // no step finished yet: its query rings restart
    int decode_steps = 0;  // decode steps finished since its last prompt chunk
  };

  // AsyncSpade (gpu_cache_topk_ahead.cc).
  Status CreatePrediction();
  // Host, in PlanStep after the entries are checked: whether the step runs ahead, and the ring
  // ops' entry tables uploaded on the cache stream.
  Status PlanPrediction(std::span<const Entry> entries, int decode_entries);
  // Cache stream: each entry's last query of `rows` into its session's ring of `layer`.
  Status PushQueries(int layer, const __nv_bfloat16* rows);
  Status LayerAhead(int layer, const __nv_bfloat16* qkv, cudaStream_t main);
  // Cache stream: the selection into the pack, the layer's tallies, pack_ready_.
  Status SelectIntoPack(int layer, DeviceQueries queries, const std::string& where);
  DeviceDeltaPack Pack() const;

  ModelConfig config_;
  GpuCacheTopKOptions options_;
  bool same_device_ = false;
  int capacity_ = 0;   // compact rows per (request, layer, KV head): sink + top_k
  int max_bound_ = 0;  // the largest grid bound PlanStep takes
  std::unique_ptr<DeviceKvStore> store_;       // cache device
  std::unique_ptr<DeviceCompactPools> pools_;  // model device
  std::vector<Session> sessions_;

  cudaStream_t cache_stream_ = nullptr;
  cudaEvent_t rows_ready_ = nullptr;    // main -> cache (model device)
  cudaEvent_t pack_ready_ = nullptr;    // cache -> main (cache device)
  cudaEvent_t inputs_ready_ = nullptr;  // cache -> main: the store's step tables uploaded
  std::vector<cudaEvent_t> wait_begin_, wait_end_;  // [layer], model device
  bool measure_waits_ = false;

  // The delta pack of one layer on the cache device (DeviceDeltaOutputs), [max_requests] entries.
  cuda::DeviceBuffer<int32_t> pack_counts_, pack_entering_, pack_slots_, pack_positions_;
  cuda::DeviceBuffer<__nv_bfloat16> pack_keys_, pack_values_;
  // [layer][2][max_requests][kv_heads] on the cache device: each layer's counts and entering
  // rows, read once after the step (FinishStep).
  cuda::DeviceBuffer<int32_t> tallies_;
  std::vector<int32_t> tallies_host_;
  cuda::DeviceBuffer<__nv_bfloat16> rows_buffer_;  // cache device, when it is another GPU

  // Step inputs on the model device, [2][max_rows] int32: each entry's pool (the scatter's and
  // the attention's compact slots), each decode entry's recent_begin.
  cuda::DeviceBuffer<int32_t> step_inputs_;
  PinnedBuffer staging_[2];
  cudaEvent_t staged_[2] = {};
  int staging_index_ = 0;

  // The planned step.
  std::vector<DeviceStepEntry> store_entries_;
  std::vector<int> step_sessions_;
  int entries_ = 0;
  int decode_entries_ = 0;
  int rows_ = 0;
  int max_seq_len_ = 0;
  bool planned_ = false;

  // AsyncSpade's state: on the cache device each layer's rings [layer][max_requests][query
  // heads][W + 1][head_dim] fp32 (slot = session), next and count [layer][2][max_requests][query
  // heads], the predictions [max_requests][query heads][head_dim] and their bf16 rows
  // [max_requests][predicted_stride_], the ring ops' entry tables [3][max_requests] (slot, row,
  // restart); on the model device the scatter's side stream and its events.
  int ring_capacity_ = 0;
  cuda::DeviceBuffer<float> rings_;
  cuda::DeviceBuffer<int32_t> ring_state_;
  cuda::DeviceBuffer<float> predicted_;
  cuda::DeviceBuffer<__nv_bfloat16> predicted_rows_;
  int64_t predicted_stride_ = 0;
  cuda::DeviceBuffer<int32_t> ring_entries_;
  std::vector<int32_t> ring_entries_host_;
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t rows_copied_ = nullptr;  // cache device: the layer's rows are in rows_buffer_
  cudaEvent_t attended_ = nullptr;     // model device: the layer's attention read the pools
  cudaEvent_t scattered_ = nullptr;    // model device: the layer's pack is in the pools
  bool ahead_ = false;
  bool last_ahead_ = false;        // the last finished step's
  bool scatter_recorded_ = false;  // scattered_ holds this step's last scatter
  uint64_t predicted_steps_ = 0;
  double wait_ms_total_ = 0;

  GpuCacheTopKBytes last_step_, totals_;
  uint64_t steps_ = 0;
  std::function<void(const GpuCacheTopKBytes&)> step_observer_;
};

}  // namespace rubato
