// The inference rank's side of the device data plane to a GPU cache rank in its own process
// (cache_rank/device/device_attention_server.h is the other side; transport/device_step.h the
// messages): per step one descriptor (the step's rows as runs, decode rows first), uploaded and
// sent on the model's stream; per layer one group on the model's stream after RoPE: the
// layer's q|k|v rows [rows][q_dim + 2 kv_dim] bf16 out as the model has them, the decode rows'
// attention [decode rows][q_dim] bf16 received straight into the model's attention rows. Only
// stream order joins the two (no host staging, no host wait in a step); over NCCL a layer may
// be captured in a CUDA graph. Not thread-safe: the model's thread drives it.
// docs/disaggregated.md "A GPU cache rank in its own process".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>

#include "common/hf_config.h"
#include "common/status.h"
#include "kernels/cuda/device_buffer.h"
#include "transport/device_step.h"
#include "transport/stream_exchange.h"

namespace rubato {

struct DevicePlaneClientOptions {
  DevicePlaneLimits limits;  // the same on the cache rank
  int peer = 0;              // the cache rank's rank in the transport
  // Bounds the wait for the cache rank's posts (in-process transports) and the release of a
  // step's transfers.
  std::chrono::milliseconds transfer_timeout{30000};
  // Whether the model may capture a layer's exchange in a CUDA graph where the transport allows
  // it (nccl): the cache rank's side runs eagerly, ops matching the graph's one for one.
  bool capture = true;
};

class DevicePlaneClient {
 public:
  // Buffers on the current device (the model's). `transport` outlives the client.
  static Result<std::unique_ptr<DevicePlaneClient>> Create(
      const ModelConfig& config, transport::StreamOrderedTransport& transport,
      const DevicePlaneClientOptions& options);
  ~DevicePlaneClient();
  DevicePlaneClient(const DevicePlaneClient&) = delete;
  DevicePlaneClient& operator=(const DevicePlaneClient&) = delete;

  // Host, outside any capture, once the last step's work is done: the step's runs in the
  // model's row order (the first decode_rows rows decode tokens, a run each), and the decode
  // rows' key bound of the model's own attention launch. Sends the descriptor on `main`.
  // `num_splits`: the attention's key splits per decode row (0: the cache rank's choice).
  Status PlanStep(std::span<const DeviceStepRun> runs, int decode_rows, int max_seq_len,
                  cudaStream_t main, int num_splits = 0);
  // Device, on `main` after the layer's q|k|v rows are final (eager or captured where
  // capturable()): rows out, and with decode rows their attention into `attention` (rows [0,
  // decode rows), stride q_dim); `main` orders after both.
  Status Layer(int layer, const __nv_bfloat16* qkv, __nv_bfloat16* attention, cudaStream_t main);
  // Layer in two groups, for several cache ranks on one stream: Send the rows to every rank,
  // then Receive from every rank, so that their GPUs attend at the same time (one group each
  // would make each rank's attention wait for the previous rank's reply).
  Status Send(int layer, const __nv_bfloat16* qkv, cudaStream_t main);
  Status Receive(int layer, __nv_bfloat16* attention, cudaStream_t main);
  // Tells the cache rank's loop to end (a stop descriptor); the data plane serves no more steps.
  Status Stop(cudaStream_t main);

  bool capturable() const { return options_.capture && exchange_.capturable(); }
  std::string_view backend_name() { return exchange_.transport().BackendName(); }
  const DevicePlaneLimits& limits() const { return options_.limits; }
  // Bytes of the last planned step each way (descriptor and every layer), and their sums.
  size_t step_bytes_out() const { return step_bytes_out_; }
  size_t step_bytes_back() const { return step_bytes_back_; }
  uint64_t total_bytes_out() const { return total_bytes_out_; }
  uint64_t total_bytes_back() const { return total_bytes_back_; }
  size_t device_bytes() const { return descriptor_.bytes(); }

 private:
  DevicePlaneClient(const ModelConfig& config, transport::StreamOrderedTransport& transport,
                    const DevicePlaneClientOptions& options);
  Status SendDescriptor(const DeviceStep& step, cudaStream_t main);
  Status CheckLayer(int layer) const;

  const ModelConfig config_;
  const DevicePlaneClientOptions options_;
  transport::StreamExchange exchange_;
  int rows_ = 0;  // of the planned step; 0: none planned
  int decode_rows_ = 0;
  uint64_t step_ = 0;
  size_t step_bytes_out_ = 0;
  size_t step_bytes_back_ = 0;
  uint64_t total_bytes_out_ = 0;
  uint64_t total_bytes_back_ = 0;

  cuda::DeviceBuffer<std::byte> descriptor_;    // DeviceStepBytes(limits), sent
  std::byte* staging_[2] = {nullptr, nullptr};  // pinned host copies, alternating by step
  cudaEvent_t staged_[2] = {nullptr, nullptr};  // each one's upload done
  int staging_index_ = 0;
  DeviceStep scratch_;  // the step being encoded (its runs' storage reused)
};

}  // namespace rubato
