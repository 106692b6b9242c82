// Attention on a GPU cache rank inside this process (see gpu_cache_attention.h).
#include "inference_rank/residency/offloaded/gpu_cache_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "inference_rank/model/cuda_forward_plan.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_scope.h"
#include "kernels/cuda/kv_append.cuh"
#include "kernels/cuda/peer_access.h"
#include "kernels/cuda/random_fill.cuh"

namespace rubato {
namespace {

using cuda::DeviceScope;

int CeilDiv(int a, int b) { return (a + b - 1) / b; }

}  // namespace

Result<std::unique_ptr<GpuCacheAttention>> GpuCacheAttention::Create(
    const ModelConfig& config, const GpuCacheAttentionOptions& options) {
  if (options.max_rows < 1 || options.max_context < 1 || options.budget_bytes == 0) {
    return InvalidArgumentError(
        "GPU cache attention: max_rows, max_context and budget_bytes must be positive");
  }
  if (options.block_tokens != 16 && options.block_tokens != 64) {
    return InvalidArgumentError("GPU cache attention: block_tokens must be 16 or 64, got " +
                                std::to_string(options.block_tokens));
  }
  auto self = std::unique_ptr<GpuCacheAttention>(new GpuCacheAttention());
  self->config_ = config;
  self->options_ = options;
  self->same_device_ = options.model_device == options.cache_device;
  // The model's decode attention bucket (cuda_forward_plan.h) may pass the longest session: the
  // grid's bound (PlanStep's max_seq_len), the tables' width and the workspace allow for it.
  self->max_seq_len_bound_ = DecodeSeqLenBucket(options.max_context, INT32_MAX);
  self->table_stride_ = CeilDiv(self->max_seq_len_bound_, options.block_tokens);

  KvCacheShape shape;
  shape.num_layers = config.num_layers;
  shape.num_kv_heads = config.num_kv_heads;
  shape.head_dim = config.head_dim;
  shape.block_tokens = options.block_tokens;
  shape.num_blocks = 1;
  const size_t block_bytes = DeviceKvStorage::PoolBytes(shape);
  shape.num_blocks = static_cast<int>(
      std::min<size_t>(options.budget_bytes / block_bytes, static_cast<size_t>(INT32_MAX)));
  if (shape.num_blocks < 1) {
    return InvalidArgumentError("GPU cache attention: a budget of " +
                                std::to_string(options.budget_bytes) + " bytes holds no block of " +
                                std::to_string(block_bytes));
  }

  DeviceScope scope(options.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  if (!self->same_device_) {
    // Copies between the two GPUs are plain cudaMemcpyAsync (unified addressing): capturable in a
    // graph, unlike cudaMemcpyPeerAsync; peer access makes them direct over NVLink.
    for (auto [from, to] : {std::pair{options.cache_device, options.model_device},
                            std::pair{options.model_device, options.cache_device}}) {
      RUBATO_RETURN_IF_ERROR(cuda::EnablePeerAccessOnce(from, to).status());
    }
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.cache_device), "selecting the cache GPU");
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<DeviceKvStorage> pools, DeviceKvStorage::Create(shape));
  self->pools_ = pools.get();
  RUBATO_ASSIGN_OR_RETURN(self->store_, PagedKvCache::CreateWithStorage(shape, std::move(pools)));

  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&self->cache_stream_, cudaStreamNonBlocking),
      "creating the cache GPU's stream");
  // An event is recorded on a stream of its own device: rows_ready_ on the model's stream, the
  // others on the cache GPU's.
  for (cudaEvent_t* event :
       {&self->output_ready_, &self->inputs_ready_, &self->staged_[0], &self->staged_[1]}) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(event, cudaEventDisableTiming),
                                "creating a cache GPU event");
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.model_device), "selecting the model's GPU");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&self->rows_ready_, cudaEventDisableTiming),
                              "creating a model GPU event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.cache_device), "selecting the cache GPU");
  const size_t rows = static_cast<size_t>(options.max_rows);
  const size_t input_ints = rows * (2 + static_cast<size_t>(self->table_stride_));
  RUBATO_ASSIGN_OR_RETURN(self->step_inputs_,
                          cuda::DeviceBuffer<int32_t>::Allocate(input_ints, "cache step inputs"));
  for (PinnedBuffer& staging : self->staging_) {
    RUBATO_ASSIGN_OR_RETURN(
        staging, PinnedBuffer::Allocate(input_ints * sizeof(int32_t), "cache step inputs (host)"));
  }
  // Compact row buffers on the cache GPU: the step's rows gathered from the model's (also on one
  // GPU, when the step's rows are not all the model's rows).
  const size_t qkv_dim = static_cast<size_t>(config.q_dim() + 2 * config.kv_dim());
  RUBATO_ASSIGN_OR_RETURN(self->rows_buffer_, cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                                  rows * qkv_dim, "cache q|k|v rows"));
  RUBATO_ASSIGN_OR_RETURN(self->output_buffer_, cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                                    rows * config.q_dim(), "cache attention rows"));
  const size_t workspace = cuda::DecodeAttentionWorkspaceBytes(
      options.max_rows, config.num_heads, config.head_dim, self->max_seq_len_bound_, false);
  RUBATO_ASSIGN_OR_RETURN(self->workspace_,
                          cuda::DeviceBuffer<unsigned char>::Allocate(
                              std::max<size_t>(workspace, 1), "cache decode attention workspace"));
  return self;
}

GpuCacheAttention::~GpuCacheAttention() {
  int previous = 0;
  (void)cudaGetDevice(&previous);
  (void)cudaSetDevice(options_.cache_device);
  if (cache_stream_ != nullptr) (void)cudaStreamSynchronize(cache_stream_);
  for (cudaEvent_t event : {rows_ready_, output_ready_, inputs_ready_, staged_[0], staged_[1]}) {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
  if (cache_stream_ != nullptr) (void)cudaStreamDestroy(cache_stream_);
  (void)cudaSetDevice(options_.model_device);
  for (std::vector<cudaEvent_t>* events : {&wait_begin_, &wait_end_}) {
    for (cudaEvent_t event : *events) (void)cudaEventDestroy(event);
  }
  (void)cudaSetDevice(previous);
}

size_t GpuCacheAttention::step_bytes_out() const {
  const size_t qkv_dim = static_cast<size_t>(config_.q_dim() + 2 * config_.kv_dim());
  return static_cast<size_t>(config_.num_layers) * rows_ * qkv_dim * sizeof(__nv_bfloat16);
}

size_t GpuCacheAttention::step_bytes_back() const {
  return static_cast<size_t>(config_.num_layers) * decode_rows_ * config_.q_dim() *
         sizeof(__nv_bfloat16);
}

Status GpuCacheAttention::SetMeasureWaits(bool on) {
  measure_waits_ = on;
  if (!on || !wait_begin_.empty()) return Status::Ok();
  DeviceScope scope(options_.model_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  for (std::vector<cudaEvent_t>* events : {&wait_begin_, &wait_end_}) {
    events->assign(static_cast<size_t>(config_.num_layers), nullptr);
    for (cudaEvent_t& event : *events) {
      RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&event), "creating a wait timing event");
    }
  }
  return Status::Ok();
}

Result<double> GpuCacheAttention::LastStepWaitMs() const {
  if (!measure_waits_) return FailedPreconditionError("GPU cache attention: waits not measured");
  double total = 0;
  for (size_t layer = 0; layer < wait_begin_.size(); ++layer) {
    float ms = 0;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, wait_begin_[layer], wait_end_[layer]),
                                "reading a layer's exposed wait");
    total += ms;
  }
  return total;
}

size_t GpuCacheAttention::device_bytes() const {
  return store_->pool_bytes() + step_inputs_.bytes() + rows_buffer_.bytes() +
         output_buffer_.bytes() + workspace_.bytes();
}

Status GpuCacheAttention::FillRandom(uint64_t seed) {
  DeviceScope scope(options_.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  uint64_t stream_id = 0;
  for (cuda::DeviceBuffer<__nv_bfloat16>* pool : {&pools_->keys(), &pools_->values()}) {
    cuda::RandomFillParams fill;
    fill.out = pool->data();
    fill.count = static_cast<int64_t>(pool->size());
    fill.seed = seed;
    fill.stream = stream_id++;
    fill.bound = 1.f;
    RUBATO_RETURN_IF_ERROR(cuda::RandomFill(fill, cache_stream_));
  }
  return cuda::CudaStatus(cudaStreamSynchronize(cache_stream_), "filling the cache GPU's store");
}

Result<int> GpuCacheAttention::OpenSession(int capacity_tokens) {
  if (capacity_tokens < 1 || capacity_tokens > options_.max_context) {
    return InvalidArgumentError("GPU cache attention: a session of " +
                                std::to_string(capacity_tokens) + " tokens (max_context " +
                                std::to_string(options_.max_context) + ")");
  }
  size_t id = 0;
  while (id < open_.size() && open_[id]) ++id;
  if (id == open_.size()) {
    open_.push_back(false);
    sessions_.emplace_back();
  }
  KvSequence& sequence = sessions_[id];
  sequence = KvSequence();
  const Status reserved = store_->Reserve(sequence, capacity_tokens);
  if (!reserved.ok()) {
    return ResourceExhaustedError("GPU cache attention: a session of " +
                                  std::to_string(capacity_tokens) + " tokens needs " +
                                  std::to_string(store_->BlocksFor(capacity_tokens)) + " blocks; " +
                                  std::to_string(store_->free_blocks()) + " of the budget's " +
                                  std::to_string(store_->shape().num_blocks) + " are free (" +
                                  std::to_string(options_.budget_bytes) + " bytes)");
  }
  open_[id] = true;
  return static_cast<int>(id);
}

Status GpuCacheAttention::CloseSession(int session) {
  if (session < 0 || static_cast<size_t>(session) >= open_.size() || !open_[session]) {
    return InvalidArgumentError("GPU cache attention: no open session " + std::to_string(session));
  }
  open_[session] = false;
  return store_->Release(sessions_[session]);
}

Status GpuCacheAttention::PlanStep(std::span<const Row> rows, int decode_rows, cudaStream_t main,
                                   int max_seq_len, int num_splits) {
  if (rows.empty() || static_cast<int>(rows.size()) > options_.max_rows || decode_rows < 0 ||
      decode_rows > static_cast<int>(rows.size()) || num_splits < 0) {
    return InvalidArgumentError("GPU cache attention: a step of " + std::to_string(rows.size()) +
                                " rows (" + std::to_string(decode_rows) + " decode; at most " +
                                std::to_string(options_.max_rows) + "), " +
                                std::to_string(num_splits) + " splits");
  }
  // The copies each way: runs of rows that are consecutive model rows.
  in_runs_.clear();
  out_runs_.clear();
  model_rows_are_rows_ = true;
  for (int r = 0; r < static_cast<int>(rows.size()); ++r) {
    const int model_row =
        rows[static_cast<size_t>(r)].model_row < 0 ? r : rows[static_cast<size_t>(r)].model_row;
    if (r > 0 && model_row <= in_runs_.back().model_row + in_runs_.back().count - 1) {
      return InvalidArgumentError("GPU cache attention: row " + std::to_string(r) +
                                  " is model row " + std::to_string(model_row) +
                                  ", not after the row before it");
    }
    model_rows_are_rows_ = model_rows_are_rows_ && model_row == r;
    for (std::vector<Run>* runs : {&in_runs_, &out_runs_}) {
      if (runs == &out_runs_ && r >= decode_rows) continue;
      if (!runs->empty() && runs->back().model_row + runs->back().count == model_row) {
        ++runs->back().count;
      } else {
        runs->push_back(Run{r, model_row, 1});
      }
    }
  }
  const int bt = store_->shape().block_tokens;
  const size_t max_rows = static_cast<size_t>(options_.max_rows);
  // The buffer this step writes was uploaded two steps ago: that copy is long done.
  PinnedBuffer& staging = staging_[staging_index_];
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staged_[staging_index_]),
                              "waiting for an old step-input upload");
  auto* ints = reinterpret_cast<int32_t*>(staging.data());
  int32_t* slots = ints;
  int32_t* seq_lens = ints + max_rows;
  int32_t* tables = ints + 2 * max_rows;
  max_seq_len_ = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const Row& row = rows[r];
    if (row.session < 0 || static_cast<size_t>(row.session) >= open_.size() ||
        !open_[row.session]) {
      return InvalidArgumentError("GPU cache attention: row " + std::to_string(r) +
                                  " names no open session (" + std::to_string(row.session) + ")");
    }
    const KvSequence& sequence = sessions_[row.session];
    const int capacity = store_->Capacity(sequence);
    if (row.position < 0 || row.position >= capacity) {
      return OutOfRangeError("GPU cache attention: row " + std::to_string(r) + " at position " +
                             std::to_string(row.position) + " past its session's " +
                             std::to_string(capacity) + " tokens");
    }
    slots[r] = sequence.block_table[row.position / bt] * bt + row.position % bt;
    if (static_cast<int>(r) >= decode_rows) continue;
    const int keys = row.position + 1;
    seq_lens[r] = keys;
    max_seq_len_ = std::max(max_seq_len_, keys);
    int32_t* table = tables + r * table_stride_;
    const int blocks = CeilDiv(keys, bt);
    std::copy_n(sequence.block_table.begin(), blocks, table);
    std::fill(table + blocks, table + table_stride_, 0);
  }
  if (max_seq_len != 0) {
    if (max_seq_len < max_seq_len_ || max_seq_len > max_seq_len_bound_) {
      return InvalidArgumentError("GPU cache attention: max_seq_len " +
                                  std::to_string(max_seq_len) + " below the decode rows' " +
                                  std::to_string(max_seq_len_) + " keys or past " +
                                  std::to_string(max_seq_len_bound_));
    }
    max_seq_len_ = max_seq_len;
  }
  rows_ = static_cast<int>(rows.size());
  decode_rows_ = decode_rows;
  num_splits_ = num_splits;
  total_bytes_out_ += step_bytes_out();
  total_bytes_back_ += step_bytes_back();
  if (step_observer_) step_observer_(step_bytes_out(), step_bytes_back());

  DeviceScope scope(options_.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  // Only what the step uses: slots and key counts, then the decode rows' tables (the buffer is
  // sized for max_rows tables of the widest bucket, megabytes with a prefill chunk's rows).
  const size_t used_ints = 2 * max_rows + static_cast<size_t>(decode_rows) * table_stride_;
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(step_inputs_.data(), ints, used_ints * sizeof(int32_t),
                      cudaMemcpyHostToDevice, cache_stream_),
      "uploading the cache step inputs");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(staged_[staging_index_], cache_stream_),
                              "recording the step-input upload");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(inputs_ready_, cache_stream_),
                              "recording the step inputs");
  staging_index_ ^= 1;
  // The model's stream (and any graph launched on it) orders its layers after the upload.
  return cuda::CudaStatus(cudaStreamWaitEvent(main, inputs_ready_, 0),
                          "ordering the step after its cache inputs");
}

Status GpuCacheAttention::Layer(int layer, const __nv_bfloat16* qkv, __nv_bfloat16* attention,
                                cudaStream_t main) {
  RUBATO_RETURN_IF_ERROR(Send(layer, qkv, attention, main));
  return Join(layer, main);
}

Status GpuCacheAttention::Send(int layer, const __nv_bfloat16* qkv, __nv_bfloat16* attention,
                               cudaStream_t main) {
  if (layer < 0 || layer >= config_.num_layers || rows_ == 0) {
    return InvalidArgumentError("GPU cache attention: layer " + std::to_string(layer) +
                                " outside a planned step");
  }
  const int q_dim = config_.q_dim();
  const int kv_dim = config_.kv_dim();
  const int64_t qkv_dim = q_dim + 2 * kv_dim;
  const std::string where = "cache attention of layer " + std::to_string(layer);
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(rows_ready_, main), where);
  DeviceScope scope(options_.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(cache_stream_, rows_ready_, 0), where);
  // On one GPU with the model's rows, in place; else gathered into the cache GPU's buffers, one
  // copy per run of consecutive model rows.
  const bool in_place = same_device_ && model_rows_are_rows_;
  const __nv_bfloat16* rows = qkv;
  __nv_bfloat16* output = attention;
  if (!in_place) {
    for (const Run& run : in_runs_) {
      RUBATO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(rows_buffer_.data() + static_cast<size_t>(run.first) * qkv_dim,
                          qkv + static_cast<size_t>(run.model_row) * qkv_dim,
                          static_cast<size_t>(run.count) * qkv_dim * sizeof(__nv_bfloat16),
                          cudaMemcpyDefault, cache_stream_),
          where + ": q|k|v rows to the cache GPU");
    }
    rows = rows_buffer_.data();
    output = output_buffer_.data();
  }
  const size_t max_rows = static_cast<size_t>(options_.max_rows);
  const int32_t* slots = step_inputs_.data();
  const int32_t* seq_lens = step_inputs_.data() + max_rows;
  const int32_t* tables = step_inputs_.data() + 2 * max_rows;

  cuda::KvAppendParams append;
  append.keys = rows + q_dim;
  append.values = rows + q_dim + kv_dim;
  append.row_stride = qkv_dim;
  append.slots = slots;
  append.tokens = rows_;
  append.num_kv_heads = config_.num_kv_heads;
  append.head_dim = config_.head_dim;
  append.block_tokens = store_->shape().block_tokens;
  append.key_pool = pools_->layer_keys(layer);
  append.value_pool = pools_->layer_values(layer);
  RUBATO_RETURN_IF_ERROR(cuda::AppendToPagedKv(append, cache_stream_));

  if (decode_rows_ > 0) {
    cuda::DecodeAttentionParams p;
    p.q = rows;
    p.q_row_stride = qkv_dim;
    p.key_pool = pools_->layer_keys(layer);
    p.value_pool = pools_->layer_values(layer);
    p.num_pool_blocks = store_->shape().num_blocks;
    p.block_tables = tables;
    p.block_table_stride = table_stride_;
    p.seq_lens = seq_lens;
    p.batch = decode_rows_;
    p.num_heads = config_.num_heads;
    p.num_kv_heads = config_.num_kv_heads;
    p.head_dim = config_.head_dim;
    p.block_tokens = store_->shape().block_tokens;
    p.max_seq_len = max_seq_len_;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(config_.head_dim)));
    p.out = output;
    p.out_row_stride = q_dim;
    p.workspace = workspace_.data();
    p.workspace_bytes = workspace_.bytes();
    p.num_splits = num_splits_;
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(p, cache_stream_).WithContext(where));
    for (const Run& run : out_runs_) {
      if (in_place) break;  // the kernel wrote the model's rows
      RUBATO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(attention + static_cast<size_t>(run.model_row) * q_dim,
                          output + static_cast<size_t>(run.first) * q_dim,
                          static_cast<size_t>(run.count) * q_dim * sizeof(__nv_bfloat16),
                          cudaMemcpyDefault, cache_stream_),
          where + ": attention rows back to the model GPU");
    }
  }
  return cuda::CudaStatus(cudaEventRecord(output_ready_, cache_stream_), where);
}

Status GpuCacheAttention::Join(int layer, cudaStream_t main) {
  if (layer < 0 || layer >= config_.num_layers || rows_ == 0) {
    return InvalidArgumentError("GPU cache attention: joining layer " + std::to_string(layer) +
                                " outside a planned step");
  }
  const std::string where = "cache attention of layer " + std::to_string(layer);
  // Inside a capture a timing event must be an external record node to stay a real record.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (measure_waits_) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(main, &capturing), where);
  }
  const unsigned record_flags =
      capturing == cudaStreamCaptureStatusActive ? cudaEventRecordExternal : cudaEventRecordDefault;
  if (measure_waits_) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecordWithFlags(wait_begin_[layer], main, record_flags),
                                where);
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main, output_ready_, 0), where);
  if (!measure_waits_) return Status::Ok();
  return cuda::CudaStatus(cudaEventRecordWithFlags(wait_end_[layer], main, record_flags), where);
}

}  // namespace rubato
