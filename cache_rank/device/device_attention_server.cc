// The GPU cache rank's data plane for attention sessions (device_attention_server.h): the wait
// for a descriptor, the step's plan and its layers, enqueued without host synchronization.
#include "cache_rank/device/device_attention_server.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/kv_append.cuh"

namespace rubato {
namespace {

using transport::MemoryKind;
using transport::TransferOp;

Status FreeHost(std::byte*& pointer) {
  if (pointer == nullptr) return Status::Ok();
  const cudaError_t freed = cudaFreeHost(pointer);
  pointer = nullptr;
  return cuda::CudaStatus(freed, "device attention server: freeing pinned memory");
}

Result<std::byte*> AllocateHost(size_t bytes, const char* what) {
  void* pointer = nullptr;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pointer, std::max<size_t>(bytes, 1), 0), what);
  return static_cast<std::byte*>(pointer);
}

}  // namespace

DeviceAttentionServer::DeviceAttentionServer(DeviceKvStore& store, std::mutex& store_mutex,
                                             transport::StreamOrderedTransport& transport,
                                             const DeviceAttentionServerOptions& options)
    : store_(store),
      store_mutex_(store_mutex),
      transport_(transport),
      exchange_(transport, options.transfer_timeout),
      options_(options) {}

Result<std::unique_ptr<DeviceAttentionServer>> DeviceAttentionServer::Create(
    DeviceKvStore& store, std::mutex& store_mutex, transport::StreamOrderedTransport& transport,
    const DeviceAttentionServerOptions& options) {
  RUBATO_RETURN_IF_ERROR(options.limits.Check());
  if (!transport.SupportsMemory(MemoryKind::kCuda)) {
    return InvalidArgumentError(
        fmt::format("device attention server: the {} transport cannot carry device memory (nccl or "
                    "cuda_peer can)",
                    transport.BackendName()));
  }
  if (options.peer < 0 || options.peer >= transport.WorldSize() ||
      options.peer == transport.Rank()) {
    return InvalidArgumentError(fmt::format("device attention server: peer {} in a world of {}",
                                            options.peer, transport.WorldSize()));
  }
  std::unique_ptr<DeviceAttentionServer> server(
      new DeviceAttentionServer(store, store_mutex, transport, options));
  const DeviceKvStoreOptions& shape = store.options();
  server->q_dim_ = shape.num_query_heads * shape.head_dim;
  server->kv_dim_ = shape.num_kv_heads * shape.head_dim;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&server->device_), "device attention server");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&server->stream_, cudaStreamNonBlocking),
                              "device attention server: creating its stream");
  const DevicePlaneLimits& limits = options.limits;
  const size_t rows = static_cast<size_t>(limits.max_rows);
  RUBATO_ASSIGN_OR_RETURN(server->descriptor_, cuda::DeviceBuffer<std::byte>::Allocate(
                                                   DeviceStepBytes(limits), "the step descriptor"));
  RUBATO_ASSIGN_OR_RETURN(server->descriptor_host_,
                          AllocateHost(DeviceStepBytes(limits), "the step descriptor (host)"));
  RUBATO_ASSIGN_OR_RETURN(server->rows_,
                          cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                              rows * (server->q_dim_ + 2 * server->kv_dim_), "q|k|v rows"));
  RUBATO_ASSIGN_OR_RETURN(
      server->output_,
      cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
          static_cast<size_t>(limits.max_runs) * server->q_dim_, "attention rows"));
  return server;
}

DeviceAttentionServer::~DeviceAttentionServer() {
  (void)cudaSetDevice(device_);
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  (void)exchange_.Drain();
  std::byte* tables = reinterpret_cast<std::byte*>(tables_host_);
  (void)FreeHost(tables);
  (void)FreeHost(descriptor_host_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

size_t DeviceAttentionServer::device_bytes() const {
  return descriptor_.bytes() + tables_.bytes() + rows_.bytes() + output_.bytes() +
         workspace_.bytes();
}

Status DeviceAttentionServer::Run(const std::atomic<bool>& stop) {
  while (true) {
    RUBATO_ASSIGN_OR_RETURN(const bool served, ServeStep(stop));
    if (!served) return Status::Ok();
  }
}

Result<bool> DeviceAttentionServer::ReceiveDescriptor(const std::atomic<bool>& stop) {
  const TransferOp recv = TransferOp::Recv(options_.peer, kDeviceStepTag, descriptor_.data(),
                                           descriptor_.bytes(), MemoryKind::kCuda);
  RUBATO_ASSIGN_OR_RETURN(const transport::TransferId id,
                          transport_.PostOnStream({&recv, 1}, stream_));
  while (true) {
    const Status waited = transport_.Wait(id, options_.poll);
    if (waited.ok()) break;
    if (waited.code() != StatusCode::kDeadlineExceeded) {
      return waited.WithContext("device attention server: waiting for a step descriptor");
    }
    if (stop.load()) {
      transport_.Cancel(id);
      return false;
    }
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(descriptor_host_, descriptor_.data(),
                                              descriptor_.bytes(), cudaMemcpyDeviceToHost, stream_),
                              "device attention server: reading the step descriptor");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_),
                              "device attention server: reading the step descriptor");
  stats_.bytes_received += descriptor_.bytes();
  return true;
}

Result<bool> DeviceAttentionServer::ServeStep(const std::atomic<bool>& stop) {
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "device attention server");
  // The last step's transfers (posted groups of in-process transports) are done or finishing.
  RUBATO_RETURN_IF_ERROR(exchange_.Drain());
  RUBATO_ASSIGN_OR_RETURN(const bool received, ReceiveDescriptor(stop));
  if (!received) return false;
  RUBATO_ASSIGN_OR_RETURN(
      step_, DecodeDeviceStep({descriptor_host_, descriptor_.bytes()}, options_.limits));
  if (step_.kind == DeviceStep::Kind::kStop) return false;
  RUBATO_RETURN_IF_ERROR(Plan().WithContext(fmt::format("step {}", step_.step)));
  const int layers = store_.options().num_layers;
  for (int layer = 0; layer < layers; ++layer) {
    RUBATO_RETURN_IF_ERROR(
        EnqueueLayer(layer).WithContext(fmt::format("step {}, layer {}", step_.step, layer)));
  }
  ++stats_.steps;
  return true;
}

Status DeviceAttentionServer::Plan() {
  const DevicePlaneLimits& limits = options_.limits;
  const int block_tokens = store_.pool_shape().block_tokens;
  std::vector<std::span<const int32_t>> tables(step_.runs.size());
  {
    std::lock_guard lock(store_mutex_);
    for (size_t r = 0; r < step_.runs.size(); ++r) {
      const DeviceStepRun& run = step_.runs[r];
      if (options_.check_session) RUBATO_RETURN_IF_ERROR(options_.check_session(run.session_id));
      RUBATO_ASSIGN_OR_RETURN(const uint32_t capacity, store_.SessionCapacity(run.session_id));
      if (uint64_t{run.first_position} + run.tokens > capacity) {
        return OutOfRangeError(fmt::format(
            "device attention server: session {}: positions [{}, {}) past its capacity of {} "
            "tokens",
            run.session_id, run.first_position, run.first_position + run.tokens, capacity));
      }
      RUBATO_ASSIGN_OR_RETURN(tables[r], store_.BlockTableView(run.session_id));
    }
    // The views stay valid after the lock: a session closed under a running step is the
    // peer's error, and its blocks are only rewritten by later steps (stream order).
  }
  // The model's max_seq_len (its graph-stable bucket) may pass every session's blocks: the
  // tables hold as many entries as the grid may read.
  int stride = std::max(1, (step_.max_seq_len + block_tokens - 1) / block_tokens);
  for (int r = 0; r < step_.decode_rows; ++r) {
    stride = std::max(stride, static_cast<int>(tables[static_cast<size_t>(r)].size()));
  }
  const size_t max_rows = static_cast<size_t>(limits.max_rows);
  const size_t max_runs = static_cast<size_t>(limits.max_runs);
  if (stride > max_stride_) {  // the stream is idle: the descriptor was read after its work
    const int grown = static_cast<int>(std::bit_ceil(static_cast<unsigned>(stride)));
    const size_t ints = max_rows + max_runs * (1 + static_cast<size_t>(grown));
    std::byte* host = reinterpret_cast<std::byte*>(tables_host_);
    RUBATO_RETURN_IF_ERROR(FreeHost(host));
    tables_host_ = nullptr;
    tables_ = {};
    RUBATO_ASSIGN_OR_RETURN(tables_, cuda::DeviceBuffer<int32_t>::Allocate(ints, "step tables"));
    RUBATO_ASSIGN_OR_RETURN(host, AllocateHost(ints * sizeof(int32_t), "step tables (host)"));
    tables_host_ = reinterpret_cast<int32_t*>(host);
    max_stride_ = grown;
  }
  stride_ = stride;
  int32_t* slots = tables_host_;
  int32_t* seq_lens = tables_host_ + max_rows;
  int32_t* block_tables = seq_lens + max_runs;
  size_t row = 0;
  for (size_t r = 0; r < step_.runs.size(); ++r) {
    const DeviceStepRun& run = step_.runs[r];
    const std::span<const int32_t> table = tables[r];
    for (uint32_t t = 0; t < run.tokens; ++t, ++row) {
      const uint32_t position = run.first_position + t;
      slots[row] = table[position / block_tokens] * block_tokens +
                   static_cast<int32_t>(position % block_tokens);
    }
    if (static_cast<int>(r) >= step_.decode_rows) continue;
    seq_lens[r] = static_cast<int32_t>(run.first_position + 1);
    int32_t* out = block_tables + r * static_cast<size_t>(stride);
    std::copy(table.begin(), table.end(), out);
    std::fill(out + table.size(), out + stride, table.back());  // past the keys: never read
  }
  const size_t bytes =
      (max_rows + max_runs + static_cast<size_t>(step_.decode_rows) * stride) * sizeof(int32_t);
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(tables_.data(), tables_host_, bytes, cudaMemcpyHostToDevice, stream_),
      "device attention server: uploading the step tables");
  if (step_.decode_rows > 0) {
    const DeviceKvStoreOptions& shape = store_.options();
    const size_t needed = cuda::DecodeAttentionWorkspaceBytes(
        step_.decode_rows, shape.num_query_heads, shape.head_dim, step_.max_seq_len, false);
    if (needed > workspace_.bytes()) {
      workspace_ = {};
      RUBATO_ASSIGN_OR_RETURN(workspace_, cuda::DeviceBuffer<unsigned char>::Allocate(
                                              std::bit_ceil(needed), "attention workspace"));
    }
  }
  // The pinned tables are rewritten by the next step only after its descriptor's host wait,
  // which follows this upload on the stream.
  return Status::Ok();
}

Status DeviceAttentionServer::EnqueueLayer(int layer) {
  const DeviceKvStoreOptions& shape = store_.options();
  const int rows = step_.rows();
  const int64_t row_dim = q_dim_ + 2 * kv_dim_;
  const TransferOp recv =
      TransferOp::Recv(options_.peer, kDeviceRowsTag, rows_.data(),
                       DeviceRowsBytes(rows, q_dim_, kv_dim_), MemoryKind::kCuda);
  RUBATO_RETURN_IF_ERROR(exchange_.Exchange({&recv, 1}, stream_));
  stats_.bytes_received += recv.bytes;

  const size_t max_rows = static_cast<size_t>(options_.limits.max_rows);
  cuda::KvAppendParams append;
  append.keys = rows_.data() + q_dim_;
  append.values = rows_.data() + q_dim_ + kv_dim_;
  append.row_stride = row_dim;
  append.slots = tables_.data();
  append.tokens = rows;
  append.num_kv_heads = shape.num_kv_heads;
  append.head_dim = shape.head_dim;
  append.block_tokens = store_.pool_shape().block_tokens;
  append.key_pool = store_.mutable_layer_keys(layer);
  append.value_pool = store_.mutable_layer_values(layer);
  RUBATO_RETURN_IF_ERROR(cuda::AppendToPagedKv(append, stream_));
  if (step_.decode_rows == 0) return Status::Ok();

  // The inference rank's own launch: the same batch, max_seq_len and scale.
  cuda::DecodeAttentionParams p;
  p.q = rows_.data();
  p.q_row_stride = row_dim;
  p.key_pool = store_.layer_keys(layer);
  p.value_pool = store_.layer_values(layer);
  p.num_pool_blocks = store_.pool_shape().num_blocks;
  p.block_tables = tables_.data() + max_rows + options_.limits.max_runs;
  p.block_table_stride = stride_;
  p.seq_lens = tables_.data() + max_rows;
  p.batch = step_.decode_rows;
  p.num_heads = shape.num_query_heads;
  p.num_kv_heads = shape.num_kv_heads;
  p.head_dim = shape.head_dim;
  p.block_tokens = store_.pool_shape().block_tokens;
  p.max_seq_len = step_.max_seq_len;
  p.num_splits = step_.num_splits;  // the inference rank's whole batch's, or 0
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
  p.out = output_.data();
  p.out_row_stride = q_dim_;
  p.workspace = workspace_.data();
  p.workspace_bytes = workspace_.bytes();
  RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(p, stream_));
  const TransferOp send =
      TransferOp::Send(options_.peer, kDeviceOutputTag, output_.data(),
                       DeviceOutputBytes(step_.decode_rows, q_dim_), MemoryKind::kCuda);
  RUBATO_RETURN_IF_ERROR(exchange_.Exchange({&send, 1}, stream_));
  stats_.bytes_sent += send.bytes;
  return Status::Ok();
}

}  // namespace rubato
