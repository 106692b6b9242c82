// oracle_topk over a GPU cache rank inside this process, with delta replies (see gpu_cache_topk.h).
#include "inference_rank/residency/offloaded/gpu_cache_topk.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <string>
#include <utility>

#include "inference_rank/model/cuda_forward_plan.h"
#include "kernels/cuda/compact_slot_update.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_scope.h"
#include "kernels/cuda/peer_access.h"
#include "kernels/cuda/query_predictor.cuh"
#include "kernels/cuda/random_fill.cuh"

namespace rubato {
namespace {

using cuda::DeviceScope;

}  // namespace

Result<std::unique_ptr<GpuCacheTopK>> GpuCacheTopK::Create(const ModelConfig& config,
                                                           const GpuCacheTopKOptions& o) {
  if (o.max_rows < 1 || o.max_requests < 1 || o.max_context < 1 || o.budget_bytes == 0 ||
      o.top_k < 1 || o.sink_tokens < 0 || o.recent_tokens < 1) {
    return InvalidArgumentError(fmt::format(
        "GPU cache top-k: max_rows {}, max_requests {}, max_context {}, budget_bytes {}, top_k "
        "{}, sink_tokens {}, recent_tokens {}: need positive sizes, sink >= 0",
        o.max_rows, o.max_requests, o.max_context, o.budget_bytes, o.top_k, o.sink_tokens,
        o.recent_tokens));
  }
  if (o.predict && (o.query_window < 1 || o.query_window > cuda::kDeviceQueryWindowMax ||
                    !(o.ridge_lambda > 0) || o.dense_steps < 0)) {
    return InvalidArgumentError(fmt::format(
        "asyncspade on a GPU cache rank: query_window {} must be in [1, {}] (the device "
        "predictor's window), ridge_lambda {} > 0, dense_steps {} >= 0",
        o.query_window, cuda::kDeviceQueryWindowMax, o.ridge_lambda, o.dense_steps));
  }
  auto self = std::unique_ptr<GpuCacheTopK>(new GpuCacheTopK());
  self->config_ = config;
  self->options_ = o;
  self->same_device_ = o.model_device == o.cache_device;
  self->capacity_ = o.sink_tokens + o.top_k;
  if (self->capacity_ > cuda::kMaxCompactSlots) {
    return InvalidArgumentError(fmt::format(
        "GPU cache top-k: sink_tokens {} + top_k {} compact rows per KV head exceed the {} a "
        "slot map holds",
        o.sink_tokens, o.top_k, cuda::kMaxCompactSlots));
  }
  // The model's decode attention bucket may pass the longest session (gpu_cache_attention.cc).
  self->max_bound_ = DecodeSeqLenBucket(o.max_context, INT32_MAX);
  const int kv_heads = config.num_kv_heads;
  const size_t pairs = static_cast<size_t>(o.max_requests) * kv_heads;
  const size_t pack_rows = pairs * static_cast<size_t>(self->capacity_);

  DeviceScope scope(o.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  if (!self->same_device_) {
    // The model stream reads the pack on the cache GPU in place (the scatter), the cache stream
    // copies the model's rows: peer access both ways where the hardware allows.
    for (auto [from, to] :
         {std::pair{o.cache_device, o.model_device}, std::pair{o.model_device, o.cache_device}}) {
      RUBATO_RETURN_IF_ERROR(cuda::EnablePeerAccessOnce(from, to).status());
    }
    RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(o.cache_device), "selecting the cache GPU");
  }
  DeviceKvStoreOptions store;
  store.num_layers = config.num_layers;
  store.num_kv_heads = kv_heads;
  store.num_query_heads = config.num_heads;
  store.head_dim = config.head_dim;
  store.block_tokens = o.block_tokens;
  store.budget_bytes = o.budget_bytes;
  store.max_batch = o.max_requests;
  store.max_step_tokens = o.max_rows;
  store.max_top_k = o.top_k;
  store.fixed_workspaces = true;  // graphs keep the workspaces' addresses
  store.max_session_tokens = self->max_bound_;
  store.delta_capacity = self->capacity_;
  store.max_delta_sessions = o.max_requests;
  store.delta_resets_by_caller = true;
  RUBATO_ASSIGN_OR_RETURN(self->store_, DeviceKvStore::Create(store));

  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&self->cache_stream_, cudaStreamNonBlocking),
      "creating the cache GPU's stream");
  for (cudaEvent_t* event : {&self->pack_ready_, &self->inputs_ready_}) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(event, cudaEventDisableTiming),
                                "creating a cache GPU event");
  }
  RUBATO_RETURN_IF_ERROR(
      cuda::AllocateAtLeastOne(self->pack_counts_, pairs, "the delta pack's counts"));
  RUBATO_RETURN_IF_ERROR(
      cuda::AllocateAtLeastOne(self->pack_entering_, pairs, "the delta pack's entering rows"));
  RUBATO_RETURN_IF_ERROR(
      cuda::AllocateAtLeastOne(self->pack_slots_, pack_rows, "the delta pack's slots"));
  RUBATO_RETURN_IF_ERROR(
      cuda::AllocateAtLeastOne(self->pack_positions_, pack_rows, "the delta pack's positions"));
  const size_t row_elements = pack_rows * static_cast<size_t>(config.head_dim);
  RUBATO_RETURN_IF_ERROR(
      cuda::AllocateAtLeastOne(self->pack_keys_, row_elements, "the delta pack's K rows"));
  RUBATO_RETURN_IF_ERROR(
      cuda::AllocateAtLeastOne(self->pack_values_, row_elements, "the delta pack's V rows"));
  const size_t tallies = static_cast<size_t>(config.num_layers) * 2 * pairs;
  RUBATO_RETURN_IF_ERROR(
      cuda::AllocateAtLeastOne(self->tallies_, tallies, "the delta packs' counts per layer"));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(self->tallies_.data(), 0, self->tallies_.bytes()),
                              "zeroing the delta packs' counts");
  self->tallies_host_.assign(tallies, 0);
  const size_t qkv_dim = static_cast<size_t>(config.q_dim() + 2 * config.kv_dim());
  if (!self->same_device_) {
    RUBATO_RETURN_IF_ERROR(cuda::AllocateAtLeastOne(
        self->rows_buffer_, static_cast<size_t>(o.max_rows) * qkv_dim, "cache q|k|v rows"));
  }

  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(o.model_device), "selecting the model's GPU");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&self->rows_ready_, cudaEventDisableTiming),
                              "creating a model GPU event");
  for (cudaEvent_t& event : self->staged_) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                "creating a model GPU event");
  }
  DeviceCompactPoolsOptions pools;
  pools.num_layers = config.num_layers;
  pools.num_kv_heads = kv_heads;
  pools.head_dim = config.head_dim;
  pools.capacity = self->capacity_;
  pools.max_requests = o.max_requests;
  RUBATO_ASSIGN_OR_RETURN(self->pools_, DeviceCompactPools::Create(pools));
  const size_t inputs = 2 * static_cast<size_t>(o.max_rows);
  RUBATO_RETURN_IF_ERROR(cuda::AllocateAtLeastOne(self->step_inputs_, inputs, "top-k step inputs"));
  for (PinnedBuffer& staging : self->staging_) {
    RUBATO_ASSIGN_OR_RETURN(
        staging, PinnedBuffer::Allocate(inputs * sizeof(int32_t), "top-k step inputs (host)"));
  }
  if (o.predict) RUBATO_RETURN_IF_ERROR(self->CreatePrediction());
  return self;
}

GpuCacheTopK::~GpuCacheTopK() {
  int previous = 0;
  (void)cudaGetDevice(&previous);
  (void)cudaSetDevice(options_.cache_device);
  if (cache_stream_ != nullptr) (void)cudaStreamSynchronize(cache_stream_);
  for (cudaEvent_t event : {pack_ready_, inputs_ready_, rows_copied_}) {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
  if (cache_stream_ != nullptr) (void)cudaStreamDestroy(cache_stream_);
  (void)cudaSetDevice(options_.model_device);
  if (side_stream_ != nullptr) (void)cudaStreamSynchronize(side_stream_);
  for (cudaEvent_t event : {rows_ready_, staged_[0], staged_[1], attended_, scattered_}) {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
  if (side_stream_ != nullptr) (void)cudaStreamDestroy(side_stream_);
  for (std::vector<cudaEvent_t>* events : {&wait_begin_, &wait_end_}) {
    for (cudaEvent_t event : *events) (void)cudaEventDestroy(event);
  }
  (void)cudaSetDevice(previous);
}

Result<int> GpuCacheTopK::OpenSession(uint64_t request_id, int capacity_tokens) {
  if (capacity_tokens < 1 || capacity_tokens > options_.max_context) {
    return InvalidArgumentError(
        fmt::format("GPU cache top-k: a session of {} tokens (max_context {})", capacity_tokens,
                    options_.max_context));
  }
  size_t id = 0;
  while (id < sessions_.size() && sessions_[id].open) ++id;
  if (id == sessions_.size()) sessions_.emplace_back();
  SessionShape shape;
  shape.num_layers = static_cast<uint32_t>(config_.num_layers);
  shape.num_kv_heads = static_cast<uint32_t>(config_.num_kv_heads);
  shape.num_query_heads = static_cast<uint32_t>(config_.num_heads);
  shape.head_dim = static_cast<uint32_t>(config_.head_dim);
  shape.dtype = DType::kBF16;
  shape.capacity_tokens = static_cast<uint32_t>(capacity_tokens);
  DeviceScope scope(options_.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  RUBATO_ASSIGN_OR_RETURN(const uint64_t store_session, store_->OpenSession(request_id, shape));
  Result<int> pool = pools_->Acquire();
  if (!pool.ok()) {
    (void)store_->CloseSession(store_session);
    return pool.status();
  }
  sessions_[id] = Session{true, store_session, *pool, false};
  return static_cast<int>(id);
}

Status GpuCacheTopK::CloseSession(int session) {
  if (session < 0 || static_cast<size_t>(session) >= sessions_.size() || !sessions_[session].open) {
    return InvalidArgumentError(fmt::format("GPU cache top-k: no open session {}", session));
  }
  Session& s = sessions_[static_cast<size_t>(session)];
  s.open = false;
  planned_ = false;  // a planned step naming it can no longer run
  const Status closed = store_->CloseSession(s.store_session);
  const Status released = pools_->Release(s.pool);
  return closed.ok() ? released : closed;
}

Status GpuCacheTopK::SetSessionLength(int session, int length) {
  if (session < 0 || static_cast<size_t>(session) >= sessions_.size() || !sessions_[session].open ||
      length < 0) {
    return InvalidArgumentError(
        fmt::format("GPU cache top-k: no open session {} (length {})", session, length));
  }
  return store_->SetSessionLength(sessions_[static_cast<size_t>(session)].store_session,
                                  static_cast<uint32_t>(length));
}

Status GpuCacheTopK::PlanStep(std::span<const Entry> entries, int decode_entries, int rows,
                              cudaStream_t main, int max_seq_len) {
  planned_ = false;
  const int count = static_cast<int>(entries.size());
  if (count < 1 || count > options_.max_requests || decode_entries < 0 || decode_entries > count ||
      rows < count || rows > options_.max_rows) {
    return InvalidArgumentError(fmt::format(
        "GPU cache top-k: a step of {} entries ({} decode) and {} rows (at most {} entries, {} "
        "rows)",
        count, decode_entries, rows, options_.max_requests, options_.max_rows));
  }
  const int64_t qkv_dim = config_.q_dim() + 2 * config_.kv_dim();
  PinnedBuffer& staging = staging_[staging_index_];
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staged_[staging_index_]),
                              "waiting for an old top-k step-input upload");
  auto* pool_index = reinterpret_cast<int32_t*>(staging.data());
  int32_t* recent_begin = pool_index + options_.max_rows;
  store_entries_.assign(static_cast<size_t>(count), DeviceStepEntry{});
  step_sessions_.assign(static_cast<size_t>(count), 0);
  int keys = 0;
  for (int b = 0; b < count; ++b) {
    const Entry& e = entries[static_cast<size_t>(b)];
    const bool decode = b < decode_entries;
    if (e.session < 0 || static_cast<size_t>(e.session) >= sessions_.size() ||
        !sessions_[static_cast<size_t>(e.session)].open || e.tokens < 1 || e.first_position < 0 ||
        e.first_row < 0 || e.first_row + e.tokens > rows ||
        (decode && (e.tokens != 1 || e.first_row != b))) {
      return InvalidArgumentError(fmt::format(
          "GPU cache top-k: entry {} (session {}, {} tokens at {}, row {}) is not an open "
          "session's rows{}",
          b, e.session, e.tokens, e.first_position, e.first_row,
          decode ? " (a decode entry is one token at its own row)" : ""));
    }
    const Session& s = sessions_[static_cast<size_t>(e.session)];
    // A planned step that never ran left the store's length ahead: the model's positions rule.
    RUBATO_ASSIGN_OR_RETURN(const uint32_t stored, store_->SessionLength(s.store_session));
    if (static_cast<uint32_t>(e.first_position) < stored) {
      RUBATO_RETURN_IF_ERROR(store_->SetSessionLength(s.store_session, e.first_position));
    }
    DeviceStepEntry& d = store_entries_[static_cast<size_t>(b)];
    d.session_id = s.store_session;
    d.first_position = static_cast<uint32_t>(e.first_position);
    d.new_tokens = static_cast<uint32_t>(e.tokens);
    d.token_stride = static_cast<uint32_t>(qkv_dim);
    d.key_offset = static_cast<uint64_t>(e.first_row * qkv_dim + config_.q_dim()) * 2;
    d.value_offset = d.key_offset + static_cast<uint64_t>(config_.kv_dim()) * 2;
    // Prefill chunks attend locally: their selection is the sink rows alone (their deltas keep
    // the pools and the maps together all the same).
    d.top_k = decode ? options_.top_k : 0;
    d.sink_tokens = options_.sink_tokens;
    d.recent_tokens = options_.recent_tokens;
    d.delta_reset = !options_.delta_replies || !s.filled;
    step_sessions_[static_cast<size_t>(b)] = e.session;
    pool_index[b] = s.pool;
    const int length = e.first_position + e.tokens;
    recent_begin[b] = std::max(0, length - options_.recent_tokens);
    if (decode) keys = std::max(keys, length);
  }
  // AsyncSpade: a step ahead attends the selection made at the last step, one position shorter,
  // so its recent window reaches one position further back.
  RUBATO_RETURN_IF_ERROR(PlanPrediction(entries, decode_entries));
  if (ahead_) {
    for (int b = 0; b < count; ++b) recent_begin[b] = std::max(0, recent_begin[b] - 1);
  }
  if (max_seq_len != 0 && (max_seq_len < keys || max_seq_len > max_bound_)) {
    return InvalidArgumentError(
        fmt::format("GPU cache top-k: max_seq_len {} below the decode rows' {} keys or past {}",
                    max_seq_len, keys, max_bound_));
  }
  // Every entry's L (prefill chunks' too) within the store's grid: the bound, else the step's.
  int bound = max_seq_len != 0 ? max_seq_len : keys;
  for (const DeviceStepEntry& d : store_entries_) {
    bound = std::max(bound, static_cast<int>(d.first_position + d.new_tokens));
  }
  bound = std::min(bound, max_bound_);
  max_seq_len_ = std::max(max_seq_len != 0 ? max_seq_len : keys, 1);
  {
    DeviceScope scope(options_.cache_device);
    RUBATO_RETURN_IF_ERROR(scope.status());
    RUBATO_RETURN_IF_ERROR(store_->BeginStep(store_entries_, cache_stream_, bound));
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(inputs_ready_, cache_stream_),
                                "recording the store's step tables");
  }
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(step_inputs_.data(), staging.data(),
                      2 * static_cast<size_t>(options_.max_rows) * sizeof(int32_t),
                      cudaMemcpyHostToDevice, main),
      "uploading the top-k step inputs");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(staged_[staging_index_], main),
                              "recording the top-k step inputs");
  staging_index_ ^= 1;
  entries_ = count;
  decode_entries_ = decode_entries;
  rows_ = rows;
  planned_ = true;
  return cuda::CudaStatus(cudaStreamWaitEvent(main, inputs_ready_, 0),
                          "ordering the step after the store's tables");
}

Status GpuCacheTopK::Layer(int layer, const __nv_bfloat16* qkv, cudaStream_t main) {
  if (layer < 0 || layer >= config_.num_layers || !planned_) {
    return InvalidArgumentError(
        fmt::format("GPU cache top-k: layer {} outside a planned step", layer));
  }
  if (ahead_) return LayerAhead(layer, qkv, main);
  const std::string where = "cache top-k of layer " + std::to_string(layer);
  const int64_t qkv_dim = config_.q_dim() + 2 * config_.kv_dim();
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(rows_ready_, main), where);
  {
    DeviceScope scope(options_.cache_device);
    RUBATO_RETURN_IF_ERROR(scope.status());
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(cache_stream_, rows_ready_, 0), where);
    const __nv_bfloat16* rows = qkv;
    if (!same_device_) {
      RUBATO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(rows_buffer_.data(), qkv,
                          static_cast<size_t>(rows_) * qkv_dim * sizeof(__nv_bfloat16),
                          cudaMemcpyDefault, cache_stream_),
          where + ": q|k|v rows to the cache GPU");
      rows = rows_buffer_.data();
    }
    RUBATO_RETURN_IF_ERROR(store_->AppendLayer(layer, rows, cache_stream_).WithContext(where));
    if (options_.predict) RUBATO_RETURN_IF_ERROR(PushQueries(layer, rows).WithContext(where));
    // Entry b's query is row b: decode entries come first, one row each (a prefill entry's
    // selects nothing: top_k 0).
    RUBATO_RETURN_IF_ERROR(SelectIntoPack(layer, DeviceQueries{rows, qkv_dim}, where));
  }
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
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main, pack_ready_, 0), where);
  if (measure_waits_) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecordWithFlags(wait_end_[layer], main, record_flags),
                                where);
  }
  // The entering rows, read on the cache GPU in place, into the pools. The next layer's
  // selection rewrites the pack only after this (it waits for that layer's rows on `main`).
  return pools_->Apply(layer, Pack(), step_inputs_.data(), main).WithContext(where);
}

Status GpuCacheTopK::SelectIntoPack(int layer, DeviceQueries queries, const std::string& where) {
  const size_t pairs = static_cast<size_t>(entries_) * config_.num_kv_heads;
  DeviceDeltaOutputs out;
  out.counts = pack_counts_.data();
  out.entering = pack_entering_.data();
  out.slots = pack_slots_.data();
  out.positions = pack_positions_.data();
  out.keys = pack_keys_.data();
  out.values = pack_values_.data();
  RUBATO_RETURN_IF_ERROR(
      store_->SelectTopKDelta(layer, queries, out, cache_stream_).WithContext(where));
  // The layer's counts and entering rows for FinishStep's bytes.
  int32_t* tally = tallies_.data() + static_cast<size_t>(layer) * 2 * options_.max_requests *
                                         static_cast<size_t>(config_.num_kv_heads);
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tally, pack_counts_.data(), pairs * sizeof(int32_t),
                                              cudaMemcpyDeviceToDevice, cache_stream_),
                              where);
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(tally + static_cast<size_t>(options_.max_requests) * config_.num_kv_heads,
                      pack_entering_.data(), pairs * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                      cache_stream_),
      where);
  return cuda::CudaStatus(cudaEventRecord(pack_ready_, cache_stream_), where);
}

DeviceDeltaPack GpuCacheTopK::Pack() const {
  DeviceDeltaPack pack;
  pack.counts = pack_counts_.data();
  pack.slots = pack_slots_.data();
  pack.positions = pack_positions_.data();
  pack.keys = pack_keys_.data();
  pack.values = pack_values_.data();
  pack.rows = capacity_;
  pack.batch = entries_;
  return pack;
}

void GpuCacheTopK::SetAttention(int layer, cuda::DecodeAttentionParams& params) const {
  pools_->SetCompactSegment(layer, step_inputs_.data(), params);
  params.recent_begin = step_inputs_.data() + options_.max_rows;
  // Predicting, a step ahead reads one position more of the recent window (PlanStep).
  params.max_recent_tokens =
      std::min(options_.recent_tokens + (options_.predict ? 1 : 0), max_seq_len_);
}

Status GpuCacheTopK::FinishStep() {
  if (!planned_) return Status::Ok();
  planned_ = false;
  const int kv_heads = config_.num_kv_heads;
  const size_t pairs = static_cast<size_t>(entries_) * kv_heads;
  const size_t layer_ints = 2 * static_cast<size_t>(options_.max_requests) * kv_heads;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemcpy(tallies_host_.data(), tallies_.data(),
                                         tallies_host_.size() * sizeof(int32_t), cudaMemcpyDefault),
                              "reading the step's delta counts");
  const uint64_t kv_row = 2 * static_cast<uint64_t>(config_.head_dim) * sizeof(__nv_bfloat16);
  GpuCacheTopKBytes step;
  step.out = static_cast<uint64_t>(config_.num_layers) * rows_ *
             (config_.q_dim() + 2 * config_.kv_dim()) * sizeof(__nv_bfloat16);
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const int32_t* counts = tallies_host_.data() + layer * layer_ints;
    const int32_t* entering = counts + static_cast<size_t>(options_.max_requests) * kv_heads;
    for (size_t pair = 0; pair < pairs; ++pair) {
      step.rows_back += static_cast<uint64_t>(std::max(entering[pair], 0));
      step.rows_full += static_cast<uint64_t>(std::max(counts[pair], 0));
    }
  }
  const uint64_t headers = static_cast<uint64_t>(config_.num_layers) * pairs * sizeof(int32_t);
  step.back = step.rows_back * (kv_row + 2 * sizeof(int32_t)) + headers;
  step.full_back = step.rows_full * (kv_row + sizeof(int32_t)) + headers;
  for (int b = 0; b < entries_; ++b) {
    Session& s = sessions_[static_cast<size_t>(step_sessions_[static_cast<size_t>(b)])];
    s.filled = true;
    s.fresh = false;
    s.decode_steps = b < decode_entries_ ? s.decode_steps + 1 : 0;
  }
  last_ahead_ = ahead_;
  if (ahead_) ++predicted_steps_;
  if (options_.predict && measure_waits_) {
    RUBATO_ASSIGN_OR_RETURN(const double wait_ms, LastStepWaitMs());
    wait_ms_total_ += wait_ms;
  }
  last_step_ = step;
  totals_.out += step.out;
  totals_.back += step.back;
  totals_.full_back += step.full_back;
  totals_.rows_back += step.rows_back;
  totals_.rows_full += step.rows_full;
  ++steps_;
  if (step_observer_) step_observer_(step);
  return Status::Ok();
}

void GpuCacheTopK::AbortStep() {
  planned_ = false;
  if (side_stream_ != nullptr) (void)cudaStreamSynchronize(side_stream_);
  DeviceScope scope(options_.cache_device);
  if (cache_stream_ != nullptr) (void)cudaStreamSynchronize(cache_stream_);
}

Status GpuCacheTopK::SetMeasureWaits(bool on) {
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

Result<double> GpuCacheTopK::LastStepWaitMs() const {
  if (!measure_waits_) return FailedPreconditionError("GPU cache top-k: waits not measured");
  double total = 0;
  // A step ahead times only its join, at the last layer.
  for (size_t layer = last_ahead_ ? wait_begin_.size() - 1 : 0; layer < wait_begin_.size();
       ++layer) {
    float ms = 0;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, wait_begin_[layer], wait_end_[layer]),
                                "reading a layer's exposed wait");
    total += ms;
  }
  return total;
}

Status GpuCacheTopK::FillRandom(uint64_t seed) {
  DeviceScope scope(options_.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  const KvCacheShape& shape = store_->pool_shape();
  const int64_t elements = static_cast<int64_t>(shape.num_layers) * shape.num_blocks *
                           shape.num_kv_heads * shape.block_tokens * shape.head_dim;
  uint64_t stream_id = 0;
  for (__nv_bfloat16* pool : {store_->mutable_layer_keys(0), store_->mutable_layer_values(0)}) {
    cuda::RandomFillParams fill;
    fill.out = pool;
    fill.count = elements;
    fill.seed = seed;
    fill.stream = stream_id++;
    fill.bound = 1.f;
    RUBATO_RETURN_IF_ERROR(cuda::RandomFill(fill, cache_stream_));
  }
  return cuda::CudaStatus(cudaStreamSynchronize(cache_stream_), "filling the cache GPU's store");
}

size_t GpuCacheTopK::cache_device_bytes() const {
  return store_->Stats().device_bytes + pack_counts_.bytes() + pack_entering_.bytes() +
         pack_slots_.bytes() + pack_positions_.bytes() + pack_keys_.bytes() + pack_values_.bytes() +
         tallies_.bytes() + rows_buffer_.bytes();
}

size_t GpuCacheTopK::model_device_bytes() const {
  return pools_->device_bytes() + step_inputs_.bytes();
}

}  // namespace rubato
