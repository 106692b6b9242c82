// Attention on a GPU cache rank inside this process (docs/design.md §1
// "attention on the cache rank"; the colocated mode's device path): the offloaded requests' KV
// lives in a paged bf16 store on the cache GPU, and in every layer the step's q|k|v rows cross to
// it peer to peer, are appended there and attended by the same kernels/cuda ops as local dense
// attention (the output has local dense's bits), and the decode rows' attention output crosses
// back. The KV is read by the cache GPU's HBM and never shipped: a layer moves rows x (q_dim + 2
// kv_dim) bf16 out and decode rows x q_dim back, whatever the context. Only stream waits on events
// order the two GPUs: no host synchronisation inside a step, and a layer can be captured in a CUDA
// graph on the model's stream. Not thread-safe: one thread (the model's) drives it.
// docs/disaggregated.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/kv/paged_kv_cache.h"
#include "inference_rank/model/cuda_kv_storage.h"
#include "inference_rank/model/cuda_pinned_buffer.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato {

struct GpuCacheAttentionOptions {
  int model_device = 0;     // where the model's q|k|v rows and attention output live
  int cache_device = 1;     // the store's GPU; may equal model_device (one GPU)
  int block_tokens = 16;    // 16 or 64
  size_t budget_bytes = 0;  // K + V bytes of the store's pool, > 0 (allocated at Create)
  int max_rows = 0;         // rows of one step (decode tokens + prefill chunk tokens), >= 1
  int max_context = 0;      // positions one session may hold, >= 1
};

class GpuCacheAttention {
 public:
  // Allocates the store (budget_bytes rounded down to whole blocks), its row buffers and step
  // inputs on the cache device and enables peer access between the two devices where the
  // hardware allows. ResourceExhausted names the bytes; InvalidArgument a bad option.
  static Result<std::unique_ptr<GpuCacheAttention>> Create(const ModelConfig& config,
                                                           const GpuCacheAttentionOptions& options);
  ~GpuCacheAttention();
  GpuCacheAttention(const GpuCacheAttention&) = delete;
  GpuCacheAttention& operator=(const GpuCacheAttention&) = delete;

  // A session that may hold positions [0, capacity_tokens): its blocks are reserved now (all
  // or nothing), so a step never runs out. ResourceExhausted names the budget.
  Result<int> OpenSession(int capacity_tokens);
  // Returns the session's blocks. Only call between steps (no layer of it in flight).
  Status CloseSession(int session);

  // One row of a step, in the model's row order.
  struct Row {
    int session = 0;
    int position = 0;
    // The row of the model's q|k|v and attention buffers it is (increasing over a step's
    // rows); -1: its index among the step's rows (every model row is the cache's).
    int model_row = -1;
  };
  // Host, outside any capture: the step's rows. The first `decode_rows` rows are decode tokens
  // (attended; their output written back), the rest prefill rows (appended only). Uploads the
  // step inputs on the cache stream; `main` waits for them before its next work.
  // `max_seq_len`: a bound of the decode rows' keys (position + 1) that fixes the attention
  // grid (the model's graph-stable bucket, DecodeSeqLenBucket, at most that of max_context);
  // 0: their maximum. `num_splits`: the attention's key splits per row (0: chosen from this
  // step's decode rows; a batch attended partly elsewhere passes the whole batch's,
  // DecodeAttentionDefaultSplits, so that every row has the bits of one launch).
  Status PlanStep(std::span<const Row> rows, int decode_rows, cudaStream_t main,
                  int max_seq_len = 0, int num_splits = 0);

  // Device, on `main` after the layer's q|k|v rows are final (after RoPE):
  //   qkv        [model rows][q_dim + 2 kv_dim] bf16 on the model device (holding PlanStep's)
  //   attention  [model rows][q_dim] bf16 on the model device: the decode rows' written
  // Every row's K/V is appended to its session; every decode row attends [0, position] of its
  // session. Send enqueues the cache GPU's work, ordered after `main`'s work so far, and returns
  // at once; Join makes `main` wait for the layer's output (main may attend other rows of the
  // same buffers in between: the cache GPU writes only its decode rows). Layer is both.
  Status Send(int layer, const __nv_bfloat16* qkv, __nv_bfloat16* attention, cudaStream_t main);
  Status Join(int layer, cudaStream_t main);
  Status Layer(int layer, const __nv_bfloat16* qkv, __nv_bfloat16* attention, cudaStream_t main);

  // Bytes the last planned step moves each way (every layer): q|k|v rows to the cache GPU and
  // attention rows back. Independent of the context.
  size_t step_bytes_out() const;
  size_t step_bytes_back() const;
  // Their sums over every planned step, and a function PlanStep calls with each step's.
  uint64_t total_bytes_out() const { return total_bytes_out_; }
  uint64_t total_bytes_back() const { return total_bytes_back_; }
  void SetStepObserver(std::function<void(size_t bytes_out, size_t bytes_back)> observer) {
    step_observer_ = std::move(observer);
  }
  // Exposed wait: with measuring on, every layer records a timing event on `main` before and
  // after its wait for the output (cudaEventRecordExternal: also inside a captured graph), and
  // LastStepWaitMs (host; after the step's work finished) sums them.
  Status SetMeasureWaits(bool on);
  Result<double> LastStepWaitMs() const;

  // Benchmarks: fills the whole store with random bf16 in [-1, 1] (kernels/cuda/random_fill),
  // then waits for it; decode speed does not depend on the values.
  Status FillRandom(uint64_t seed);

  // Device bytes this holds on the cache GPU (store, buffers, workspace).
  size_t device_bytes() const;
  int free_blocks() const { return store_->free_blocks(); }
  int num_kv_heads() const { return config_.num_kv_heads; }
  int block_tokens() const { return store_->shape().block_tokens; }

 private:
  GpuCacheAttention() = default;

  ModelConfig config_;
  GpuCacheAttentionOptions options_;
  std::unique_ptr<PagedKvCache> store_;  // block accounting; its storage is `pools_`
  DeviceKvStorage* pools_ = nullptr;     // [layer][block][kv_head][block_tokens][head_dim] bf16
  std::vector<KvSequence> sessions_;     // by session id
  std::vector<bool> open_;
  int max_seq_len_bound_ = 0;  // the largest decode attention grid bound PlanStep takes
  int table_stride_ = 0;       // blocks per session row of the step's block tables

  cudaStream_t cache_stream_ = nullptr;  // on the cache device
  cudaEvent_t rows_ready_ = nullptr;     // main -> cache: the layer's q|k|v rows are final
  cudaEvent_t output_ready_ = nullptr;   // cache -> main: the layer's attention rows arrived
  cudaEvent_t inputs_ready_ = nullptr;   // cache -> main: the step inputs are on the device
  bool same_device_ = false;

  // Step inputs on the cache device, one upload per step:
  //   slots       [max_rows] int32: physical_block * block_tokens + row of each row's position
  //   tables      [max_rows][table_stride_] int32: decode rows' block tables
  //   seq_lens    [max_rows] int32: decode rows' keys (position + 1)
  cuda::DeviceBuffer<int32_t> step_inputs_;
  PinnedBuffer staging_[2];     // host copies of step_inputs_, alternating by step
  cudaEvent_t staged_[2] = {};  // each staging buffer's upload done
  int staging_index_ = 0;
  int rows_ = 0;
  int decode_rows_ = 0;
  int max_seq_len_ = 0;
  int num_splits_ = 0;  // PlanStep's (0: the kernel's choice)
  // Consecutive rows of the step that are consecutive model rows: the copies each way. `in`
  // covers every row, `out` the decode rows; one run each when the rows are the model's.
  struct Run {
    int first = 0;      // row of the step (of rows_buffer_, output_buffer_)
    int model_row = 0;  // row of the model's buffers
    int count = 0;
  };
  std::vector<Run> in_runs_, out_runs_;
  bool model_rows_are_rows_ = true;  // the step's rows are model rows [0, rows_)
  uint64_t total_bytes_out_ = 0;
  uint64_t total_bytes_back_ = 0;
  std::function<void(size_t, size_t)> step_observer_;

  // [layer] timing events around the main stream's wait (SetMeasureWaits), on the model device.
  std::vector<cudaEvent_t> wait_begin_, wait_end_;
  bool measure_waits_ = false;

  cuda::DeviceBuffer<__nv_bfloat16> rows_buffer_;    // [max_rows][q_dim + 2 kv_dim] (cache)
  cuda::DeviceBuffer<__nv_bfloat16> output_buffer_;  // [max_rows][q_dim] (cache)
  cuda::DeviceBuffer<unsigned char> workspace_;      // decode attention's
};

}  // namespace rubato
