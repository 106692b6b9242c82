// AsyncSpade on the GPU cache rank of this process (GpuCacheTopK with `predict`; see
// gpu_cache_topk.h): the query rings, the prediction, the selection one step ahead with the
// predicted query, and the scatter of its pack into the pools after the layer's attention on a
// side stream. docs/asyncspade.md "On a GPU cache rank".
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "inference_rank/residency/offloaded/gpu_cache_topk.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_scope.h"
#include "kernels/cuda/query_predictor.cuh"
#include "kernels/cuda/query_rings.cuh"

namespace rubato {
namespace {

using cuda::DeviceScope;

// The entry tables' columns in ring_entries_.
enum Column { kSlot = 0, kRow = 1, kRestart = 2 };

}  // namespace

Status GpuCacheTopK::CreatePrediction() {
  const GpuCacheTopKOptions& o = options_;
  const size_t heads = static_cast<size_t>(config_.num_heads);
  const size_t dim = static_cast<size_t>(config_.head_dim);
  const size_t slots = static_cast<size_t>(o.max_requests);
  ring_capacity_ = o.query_window + 1;
  {
    DeviceScope scope(o.cache_device);
    RUBATO_RETURN_IF_ERROR(scope.status());
    const size_t layers = static_cast<size_t>(config_.num_layers);
    RUBATO_RETURN_IF_ERROR(cuda::AllocateAtLeastOne(
        rings_, layers * slots * heads * ring_capacity_ * dim, "AsyncSpade's query rings"));
    RUBATO_RETURN_IF_ERROR(cuda::AllocateAtLeastOne(ring_state_, layers * 2 * slots * heads,
                                                    "AsyncSpade's ring positions"));
    RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(ring_state_.data(), 0, ring_state_.bytes()),
                                "zeroing AsyncSpade's ring positions");
    RUBATO_RETURN_IF_ERROR(cuda::AllocateAtLeastOne(predicted_, slots * heads * dim,
                                                    "AsyncSpade's predicted queries"));
    predicted_stride_ = static_cast<int64_t>((heads * dim + 7) / 8 * 8);  // DeviceQueries' rule
    RUBATO_RETURN_IF_ERROR(cuda::AllocateAtLeastOne(predicted_rows_, slots * predicted_stride_,
                                                    "AsyncSpade's predicted query rows"));
    RUBATO_RETURN_IF_ERROR(
        cuda::AllocateAtLeastOne(ring_entries_, 3 * slots, "AsyncSpade's ring entries"));
    ring_entries_host_.assign(3 * slots, 0);
    if (rows_buffer_.data() == nullptr) {
      // A step ahead reads the layer's rows on the cache GPU after the model has moved on.
      const size_t qkv_dim = static_cast<size_t>(config_.q_dim() + 2 * config_.kv_dim());
      RUBATO_RETURN_IF_ERROR(cuda::AllocateAtLeastOne(
          rows_buffer_, static_cast<size_t>(o.max_rows) * qkv_dim, "cache q|k|v rows"));
    }
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&rows_copied_, cudaEventDisableTiming),
                                "creating a cache GPU event");
  }
  DeviceScope scope(o.model_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking),
                              "creating the pools' scatter stream");
  for (cudaEvent_t* event : {&attended_, &scattered_}) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(event, cudaEventDisableTiming),
                                "creating a model GPU event");
  }
  return SetMeasureWaits(true);
}

Status GpuCacheTopK::PlanPrediction(std::span<const Entry> entries, int decode_entries) {
  ahead_ = false;
  scatter_recorded_ = false;
  if (!options_.predict) return Status::Ok();
  // Ahead only when every entry decodes past its warm-up: its pools hold a selection made at
  // the last step (a step with a prompt chunk, or any entry still warming up, selects every
  // entry with its real query, as oracle_topk).
  const int warm_up = std::max(options_.dense_steps, 1);
  ahead_ = decode_entries == static_cast<int>(entries.size());
  const size_t slots = static_cast<size_t>(options_.max_requests);
  for (size_t b = 0; b < entries.size(); ++b) {
    const Entry& e = entries[b];
    const Session& s = sessions_[static_cast<size_t>(e.session)];
    if (!s.filled || s.decode_steps < warm_up) ahead_ = false;
    ring_entries_host_[kSlot * slots + b] = e.session;
    ring_entries_host_[kRow * slots + b] = e.first_row + e.tokens - 1;
    // A prompt chunk's queries are not consecutive steps: its last restarts the window (the CPU
    // selector's rule); so does a session's first step.
    ring_entries_host_[kRestart * slots + b] = e.tokens > 1 || s.fresh ? 1 : 0;
  }
  DeviceScope scope(options_.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  // From pageable memory: the call returns once the host values are staged.
  return cuda::CudaStatus(cudaMemcpyAsync(ring_entries_.data(), ring_entries_host_.data(),
                                          ring_entries_host_.size() * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, cache_stream_),
                          "uploading AsyncSpade's ring entries");
}

Status GpuCacheTopK::PushQueries(int layer, const __nv_bfloat16* rows) {
  const size_t slots = static_cast<size_t>(options_.max_requests);
  const size_t heads = static_cast<size_t>(config_.num_heads);
  cuda::PushQueryRowsParams push;
  push.ring = rings_.data() + static_cast<size_t>(layer) * slots * heads * ring_capacity_ *
                                  static_cast<size_t>(config_.head_dim);
  push.next = ring_state_.data() + static_cast<size_t>(layer) * 2 * slots * heads;
  push.count = push.next + slots * heads;
  push.rows = rows;
  push.row_stride = config_.q_dim() + 2 * config_.kv_dim();
  push.entry_slot = ring_entries_.data() + kSlot * slots;
  push.entry_row = ring_entries_.data() + kRow * slots;
  push.entry_restart = ring_entries_.data() + kRestart * slots;
  push.entries = entries_;
  push.slots = options_.max_requests;
  push.heads = config_.num_heads;
  push.capacity = ring_capacity_;
  push.dim = config_.head_dim;
  return cuda::PushQueryRows(push, cache_stream_);
}

Status GpuCacheTopK::LayerAhead(int layer, const __nv_bfloat16* qkv, cudaStream_t main) {
  const std::string where = "asyncspade on the cache GPU, layer " + std::to_string(layer);
  const int64_t qkv_dim = config_.q_dim() + 2 * config_.kv_dim();
  const size_t slots = static_cast<size_t>(options_.max_requests);
  const size_t heads = static_cast<size_t>(config_.num_heads);
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(rows_ready_, main), where);
  DeviceScope scope(options_.cache_device);
  RUBATO_RETURN_IF_ERROR(scope.status());
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(cache_stream_, rows_ready_, 0), where);
  // The model rewrites its rows in the next layer: the cache GPU works on a copy, and the model
  // waits only for that copy (AfterAttention).
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(rows_buffer_.data(), qkv,
                      static_cast<size_t>(rows_) * qkv_dim * sizeof(__nv_bfloat16),
                      cudaMemcpyDefault, cache_stream_),
      where + ": q|k|v rows to the cache GPU");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(rows_copied_, cache_stream_), where);
  const __nv_bfloat16* rows = rows_buffer_.data();
  RUBATO_RETURN_IF_ERROR(store_->AppendLayer(layer, rows, cache_stream_).WithContext(where));
  RUBATO_RETURN_IF_ERROR(PushQueries(layer, rows).WithContext(where));
  // Every slot's ring of the layer (a slot without queries predicts zeros, unread).
  cuda::PredictQueriesParams predict;
  predict.ring = rings_.data() + static_cast<size_t>(layer) * slots * heads * ring_capacity_ *
                                     static_cast<size_t>(config_.head_dim);
  predict.next = ring_state_.data() + static_cast<size_t>(layer) * 2 * slots * heads;
  predict.count = predict.next + slots * heads;
  predict.predicted = predicted_.data();
  predict.heads = static_cast<int>(slots * heads);
  predict.capacity = ring_capacity_;
  predict.dim = config_.head_dim;
  predict.max_window = options_.query_window;
  predict.ridge_lambda = options_.ridge_lambda;
  RUBATO_RETURN_IF_ERROR(cuda::PredictQueries(predict, cache_stream_).WithContext(where));
  cuda::PackPredictedQueriesParams pack;
  pack.predicted = predicted_.data();
  pack.entry_slot = ring_entries_.data() + kSlot * slots;
  pack.out = predicted_rows_.data();
  pack.out_stride = predicted_stride_;
  pack.entries = entries_;
  pack.slots = options_.max_requests;
  pack.heads = config_.num_heads;
  pack.dim = config_.head_dim;
  RUBATO_RETURN_IF_ERROR(cuda::PackPredictedQueries(pack, cache_stream_).WithContext(where));
  // The pack is rewritten only after the last layer's scatter has read it.
  if (scatter_recorded_) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(cache_stream_, scattered_, 0), where);
  }
  return SelectIntoPack(layer, DeviceQueries{predicted_rows_.data(), predicted_stride_}, where);
}

Status GpuCacheTopK::AfterAttention(int layer, cudaStream_t main) {
  if (!ahead_) return Status::Ok();
  if (layer < 0 || layer >= config_.num_layers || !planned_) {
    return InvalidArgumentError(
        fmt::format("GPU cache top-k: attention of layer {} outside a planned step", layer));
  }
  const std::string where = "asyncspade's scatter of layer " + std::to_string(layer);
  // The pools of this step's attention are the last step's selection: the new pack goes in once
  // that attention has read them, beside the model's next layer.
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(attended_, main), where);
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_stream_, attended_, 0), where);
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_stream_, pack_ready_, 0), where);
  RUBATO_RETURN_IF_ERROR(
      pools_->Apply(layer, Pack(), step_inputs_.data(), side_stream_).WithContext(where));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(scattered_, side_stream_), where);
  scatter_recorded_ = true;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main, rows_copied_, 0), where);
  if (layer != config_.num_layers - 1) return Status::Ok();
  // The join: every branch of the step back on `main` (a captured step ends there), timed.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(main, &capturing), where);
  const unsigned record_flags =
      capturing == cudaStreamCaptureStatusActive ? cudaEventRecordExternal : cudaEventRecordDefault;
  if (measure_waits_) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecordWithFlags(wait_begin_[layer], main, record_flags),
                                where);
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main, scattered_, 0), where);
  if (measure_waits_) {
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecordWithFlags(wait_end_[layer], main, record_flags),
                                where);
  }
  scatter_recorded_ = false;
  return Status::Ok();
}

}  // namespace rubato
