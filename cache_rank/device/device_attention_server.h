// The GPU cache rank's data plane for attention sessions (a cache rank in its own process,
// `rubato cache --memory device`, or a thread beside the model in the tests): serves one
// inference rank over a StreamOrderedTransport. Per step it receives the step descriptor
// (transport/device_step.h; the one host synchronization of the step, to read it), plans the
// step from its sessions in the DeviceKvStore (slots of every row, block tables of the decode
// rows: one upload), then enqueues every layer on its stream without waiting: receive the
// layer's q|k|v rows [rows][q_dim + 2 kv_dim] bf16 as the model has them, append their K/V
// (kv_append, token-major), attend each decode row over its session's [0, position] with the
// inference rank's launch shape (decode_attention, max_seq_len from the descriptor: the output
// has local dense's bits), send the output [decode rows][q_dim] bf16 back. The bytes of a layer
// depend on the step's rows, never on the context. docs/disaggregated.md "A GPU cache rank in
// its own process".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "cache_rank/device/device_kv_store.h"
#include "common/status.h"
#include "kernels/cuda/device_buffer.h"
#include "transport/device_step.h"
#include "transport/stream_exchange.h"

namespace rubato {

struct DeviceAttentionServerOptions {
  DevicePlaneLimits limits;  // the same on the inference rank
  int peer = 1;              // the inference rank's rank in the transport
  // Bounds the wait for the peer's posts of a layer (in-process transports) and the release of
  // a step's transfers.
  std::chrono::milliseconds transfer_timeout{30000};
  // How often the wait for the next descriptor looks at `stop`.
  std::chrono::milliseconds poll{50};
  // Optional: refuses a session this peer may not name (another peer's); under store_mutex.
  std::function<Status(uint64_t session_id)> check_session;
};

struct DeviceAttentionServerStats {
  std::atomic<uint64_t> steps{0};
  std::atomic<uint64_t> bytes_received{0};  // descriptors and q|k|v rows
  std::atomic<uint64_t> bytes_sent{0};      // attention rows
};

class DeviceAttentionServer {
 public:
  // Creates its stream and buffers on the current device (the store's). `store`, `store_mutex`
  // (held while a step is planned and by the control plane around OpenSession / CloseSession)
  // and `transport` must outlive the server.
  static Result<std::unique_ptr<DeviceAttentionServer>> Create(
      DeviceKvStore& store, std::mutex& store_mutex, transport::StreamOrderedTransport& transport,
      const DeviceAttentionServerOptions& options);
  ~DeviceAttentionServer();
  DeviceAttentionServer(const DeviceAttentionServer&) = delete;
  DeviceAttentionServer& operator=(const DeviceAttentionServer&) = delete;

  // Serves steps until the peer sends a stop descriptor or `stop` reads true (ok), or a step
  // fails (its error; the data plane is out of step with the peer from then on: the peer must
  // reconnect).
  Status Run(const std::atomic<bool>& stop);
  // One step: false when stopped instead.
  Result<bool> ServeStep(const std::atomic<bool>& stop);

  const DeviceAttentionServerStats& stats() const { return stats_; }
  // Device bytes of the server's buffers (not the store's).
  size_t device_bytes() const;

 private:
  DeviceAttentionServer(DeviceKvStore& store, std::mutex& store_mutex,
                        transport::StreamOrderedTransport& transport,
                        const DeviceAttentionServerOptions& options);
  // Waits for the next descriptor on the host; false when stopped first.
  Result<bool> ReceiveDescriptor(const std::atomic<bool>& stop);
  // Slots, seq_lens and block tables of step_ uploaded; the workspace sized. The stream is idle.
  Status Plan();
  Status EnqueueLayer(int layer);

  DeviceKvStore& store_;
  std::mutex& store_mutex_;
  transport::StreamOrderedTransport& transport_;
  transport::StreamExchange exchange_;
  const DeviceAttentionServerOptions options_;
  int q_dim_ = 0;
  int kv_dim_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;

  DeviceStep step_;  // the step being served
  int stride_ = 0;   // block table entries per decode row this step
  int max_stride_ = 0;

  cuda::DeviceBuffer<std::byte> descriptor_;  // DeviceStepBytes(limits), received
  std::byte* descriptor_host_ = nullptr;      // pinned copy of it
  // Step tables, one upload per step from pinned `tables_host_`:
  //   slots     [max_rows] int32: physical_block * block_tokens + row of each row's position
  //   seq_lens  [max_runs] int32: decode rows' keys (position + 1)
  //   tables    [max_runs][max_stride_] int32: decode rows' block tables (the step's stride)
  cuda::DeviceBuffer<int32_t> tables_;
  int32_t* tables_host_ = nullptr;
  cuda::DeviceBuffer<__nv_bfloat16> rows_;       // [max_rows][q_dim + 2 kv_dim], received
  cuda::DeviceBuffer<__nv_bfloat16> output_;     // [max_runs][q_dim], sent
  cuda::DeviceBuffer<unsigned char> workspace_;  // decode attention's, grown to the step's
  DeviceAttentionServerStats stats_;
};

}  // namespace rubato
