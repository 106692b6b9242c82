// MakeDeviceCacheRanksBackend (device_cache_ranks_backend.h).
#include "inference_rank/residency/offloaded/device_cache_ranks_backend.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "inference_rank/model/cuda_pinned_buffer.h"
#include "inference_rank/residency/offloaded/cache_step_split.h"
#include "inference_rank/residency/offloaded/gpu_cache_session.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/device_scope.h"
#include "kernels/cuda/gather_rows.cuh"

namespace rubato {

// Ranks whose step shapes fit DecodeGraphKey::policy (one slot each); more replay eagerly.
constexpr size_t kMaxGraphRanks = 8;

class DeviceCacheRanksBackend final : public CudaResidencyBackend {
 public:
  DeviceCacheRanksBackend(DeviceCacheRankResidency& residency, const ModelConfig& config,
                          cudaStream_t model_stream)
      : residency_(residency),
        config_(config),
        model_stream_(model_stream),
        limits_(residency.ranks_[0].client->limits()),
        active_(residency.ranks_.size(), false) {}
  ~DeviceCacheRanksBackend() override {
    for (cudaEvent_t& event : staged_) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }

  // Staging rows and indices on the model's GPU, zeroed (a lost rank's rows read them).
  Status Allocate(int device) {
    cuda::DeviceScope scope(device);
    RUBATO_RETURN_IF_ERROR(scope.status());
    const size_t width = static_cast<size_t>(config_.q_dim() + 2 * config_.kv_dim());
    const size_t max_rows = static_cast<size_t>(limits_.max_rows);
    const size_t max_runs = static_cast<size_t>(limits_.max_runs);
    RUBATO_ASSIGN_OR_RETURN(staged_rows_, cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                              max_rows * width, "the staged q|k|v rows"));
    RUBATO_ASSIGN_OR_RETURN(staged_attention_,
                            cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                max_runs * config_.q_dim(), "the staged attention rows"));
    RUBATO_ASSIGN_OR_RETURN(indices_, cuda::DeviceBuffer<int32_t>::Allocate(
                                          max_rows + max_runs, "the step's row indices"));
    RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(staged_rows_.data(), 0, staged_rows_.bytes()),
                                "zeroing the staged rows");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(staged_attention_.data(), 0, staged_attention_.bytes()),
                                "zeroing the staged attention rows");
    for (int i = 0; i < 2; ++i) {
      RUBATO_ASSIGN_OR_RETURN(
          host_indices_[i],
          PinnedBuffer::Allocate((max_rows + max_runs) * sizeof(int32_t), "step row indices"));
      RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&staged_[i], cudaEventDisableTiming),
                                  "creating an upload event");
    }
    return Status::Ok();
  }

  std::string_view residency_name() const override { return "offloaded"; }
  bool graph_replayable() const override {
    if (residency_.ranks_.size() > kMaxGraphRanks) return false;
    for (const DeviceCacheRankPeer& rank : residency_.ranks_) {
      if (!rank.client->capturable()) return false;
    }
    return true;
  }

  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override {
    return CheckDevicePlaneBatch(batch, window, limits_);
  }

  Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) override {
    RUBATO_RETURN_IF_ERROR(residency_.Broken());
    // Entries in the plan's row order: the decode rows first.
    std::vector<size_t> order(batch.size());
    for (size_t e = 0; e < batch.size(); ++e) order[e] = e;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return plan.entry_first_row[a] < plan.entry_first_row[b];
    });
    entries_.clear();
    for (const size_t e : order) {
      const ForwardEntry& entry = batch[e];
      const auto& held = static_cast<const GpuCacheSession&>(*entry.residency);
      entries_.push_back({held.cache,
                          {held.session, static_cast<uint32_t>(entry.start_position),
                           static_cast<uint32_t>(entry.tokens.size())}});
    }
    const int ranks = static_cast<int>(residency_.ranks_.size());
    RUBATO_ASSIGN_OR_RETURN(split_, SplitStepByCache(entries_, plan.decode_rows, ranks));
    rows_ = static_cast<int>(split_.gather.size());
    decode_rows_ = plan.decode_rows;
    RUBATO_RETURN_IF_ERROR(UploadIndices());
    // Every rank splits its rows' keys as one launch over the whole batch would (the same
    // kind of GPU), so that each row has local dense's bits.
    const int num_splits =
        plan.decode_rows > 0 ? cuda::DecodeAttentionDefaultSplits(
                                   plan.decode_rows, config_.num_kv_heads, plan.decode_max_seq_len)
                             : 0;
    for (int r = 0; r < ranks; ++r) {
      const CacheStepPart& part = split_.parts[static_cast<size_t>(r)];
      active_[static_cast<size_t>(r)] = false;
      if (part.runs.empty() || !residency_.RankLost(r).ok()) continue;
      const Status planned = residency_.ranks_[static_cast<size_t>(r)].client->PlanStep(
          part.runs, part.decode_rows, plan.decode_max_seq_len, model_stream_,
          part.decode_rows > 0 ? num_splits : 0);
      if (!planned.ok()) {
        residency_.MarkFailed(r, planned);
        continue;
      }
      active_[static_cast<size_t>(r)] = true;
    }
    residency_.CountSteps();
    return Status::Ok();
  }

  // Every rank's rows, decode rows and connection, one slot each (graph_replayable: at most 8
  // ranks).
  void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& key) const override {
    for (size_t r = 0; r < split_.parts.size() && r < key.policy.size(); ++r) {
      key.policy[r] = residency_.GraphKeySlot(r, split_.shape[2 * r], split_.shape[2 * r + 1]);
    }
  }

  Status LayerComputed(const CudaLayerContext& layer) override {
    const size_t width = static_cast<size_t>(config_.q_dim() + 2 * config_.kv_dim());
    RUBATO_RETURN_IF_ERROR(cuda::GatherRows({.in = layer.qkv,
                                             .in_rows = rows_,
                                             .row_indices = indices_.data(),
                                             .rows = rows_,
                                             .dim = static_cast<int>(width),
                                             .out = staged_rows_.data()},
                                            layer.stream));
    // Every rank's rows out first, then every reply: the cache GPUs attend at the same time.
    for (size_t r = 0; r < active_.size(); ++r) {
      if (!active_[r]) continue;
      const Status sent = residency_.ranks_[r].client->Send(
          layer.layer, staged_rows_.data() + split_.parts[r].first_row * width, layer.stream);
      if (!sent.ok()) Drop(r, sent);
    }
    for (size_t r = 0; r < active_.size(); ++r) {
      if (!active_[r] || split_.parts[r].decode_rows == 0) continue;
      const Status received = residency_.ranks_[r].client->Receive(
          layer.layer,
          staged_attention_.data() +
              static_cast<size_t>(split_.parts[r].first_decode_row) * config_.q_dim(),
          layer.stream);
      if (!received.ok()) Drop(r, received);
    }
    if (decode_rows_ == 0) return Status::Ok();
    return cuda::GatherRows({.in = staged_attention_.data(),
                             .in_rows = decode_rows_,
                             .row_indices = indices_.data() + limits_.max_rows,
                             .rows = decode_rows_,
                             .dim = config_.q_dim(),
                             .out = layer.attention},
                            layer.stream);
  }

  // The step's results stand unless every rank is lost; a lost rank's requests end.
  Status FinishStep() override { return residency_.Broken(); }

  Status AttendDecodeRows(const CudaLayerContext& /*layer*/, int first_row, int rows,
                          const AttentionWindow& /*window*/) override {
    return CheckDecodeRowsFromZero(first_row, rows);
  }

 private:
  // A rank whose transfer failed mid-step: left out of the rest of it, its requests end.
  void Drop(size_t rank, const Status& why) {
    residency_.MarkFailed(static_cast<int>(rank), why);
    active_[rank] = false;
  }

  // Host, outside any capture: the step's gather and scatter indices, through the pinned slot
  // of two steps ago (normally long uploaded).
  Status UploadIndices() {
    auto* host = reinterpret_cast<int32_t*>(host_indices_[slot_].data());
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staged_[slot_]),
                                "waiting for an old index upload");
    std::memcpy(host, split_.gather.data(), split_.gather.size() * sizeof(int32_t));
    std::memcpy(host + limits_.max_rows, split_.scatter.data(),
                split_.scatter.size() * sizeof(int32_t));
    const size_t bytes =
        (static_cast<size_t>(limits_.max_rows) + split_.scatter.size()) * sizeof(int32_t);
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(indices_.data(), host, bytes, cudaMemcpyHostToDevice, model_stream_),
        "uploading the step's row indices");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventRecord(staged_[slot_], model_stream_),
                                "recording the index upload");
    slot_ ^= 1;
    return Status::Ok();
  }

  DeviceCacheRankResidency& residency_;
  const ModelConfig config_;
  cudaStream_t model_stream_ = nullptr;
  const DevicePlaneLimits limits_;
  std::vector<bool> active_;  // [rank] planned this step and not dropped
  std::vector<CacheStepEntry> entries_;
  CacheStepSplit split_;
  int rows_ = 0;
  int decode_rows_ = 0;
  cuda::DeviceBuffer<__nv_bfloat16> staged_rows_;       // [max_rows][q_dim + 2 kv_dim]
  cuda::DeviceBuffer<__nv_bfloat16> staged_attention_;  // [max_runs][q_dim]
  cuda::DeviceBuffer<int32_t> indices_;  // [max_rows] gather, then [max_runs] scatter
  PinnedBuffer host_indices_[2];
  cudaEvent_t staged_[2] = {nullptr, nullptr};
  int slot_ = 0;
};

Status CheckDevicePlaneBatch(std::span<const ForwardEntry> batch, const AttentionWindow& window,
                             const DevicePlaneLimits& limits) {
  RUBATO_RETURN_IF_ERROR(CheckGpuCacheBatch(batch, window));
  size_t rows = 0;
  for (const ForwardEntry& entry : batch) rows += entry.tokens.size();
  if (batch.size() > static_cast<size_t>(limits.max_runs) ||
      rows > static_cast<size_t>(limits.max_rows)) {
    return InvalidArgumentError(
        "a step of " + std::to_string(batch.size()) + " requests and " + std::to_string(rows) +
        " tokens exceeds the GPU cache ranks' data plane (max_runs " +
        std::to_string(limits.max_runs) + ", max_rows " + std::to_string(limits.max_rows) + ")");
  }
  return Status::Ok();
}

Status CheckDecodeRowsFromZero(int first_row, int rows) {
  if (first_row == 0) return Status::Ok();
  return InternalError("GPU cache rank: decode rows from " + std::to_string(first_row) + " (" +
                       std::to_string(rows) + "), expected all from 0");
}

Result<std::unique_ptr<CudaResidencyBackend>> MakeDeviceCacheRanksBackend(
    DeviceCacheRankResidency& residency, CudaModel& model) {
  auto backend =
      std::make_unique<DeviceCacheRanksBackend>(residency, model.config(), model.stream());
  RUBATO_RETURN_IF_ERROR(backend->Allocate(model.device()));
  return std::unique_ptr<CudaResidencyBackend>(std::move(backend));
}

}  // namespace rubato
