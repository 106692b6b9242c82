// The offloaded residency over a GPU cache rank reached by the device data plane
// (device_cache_rank_residency.h): the engine half (sessions through DeviceSessionControl) and
// the CUDA half (the step's runs, every layer through DevicePlaneClient::Layer).
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/cuda_residency_backend.h"
#include "inference_rank/residency/offloaded/gpu_cache_session.h"

namespace rubato {

// The CUDA half: every row of the step is the residency's (an offloaded engine offloads every
// request), so every decode row's attention comes from the cache rank.
class DeviceCacheRankBackend final : public CudaResidencyBackend {
 public:
  DeviceCacheRankBackend(DeviceCacheRankResidency& residency, cudaStream_t model_stream)
      : residency_(residency), client_(residency.client_), model_stream_(model_stream) {}

  std::string_view residency_name() const override { return "offloaded"; }
  bool graph_replayable() const override { return client_.capturable(); }

  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override {
    RUBATO_RETURN_IF_ERROR(CheckGpuCacheBatch(batch, window));
    size_t rows = 0;
    for (const ForwardEntry& entry : batch) rows += entry.tokens.size();
    const DevicePlaneLimits& limits = client_.limits();
    if (batch.size() > static_cast<size_t>(limits.max_runs) ||
        rows > static_cast<size_t>(limits.max_rows)) {
      return InvalidArgumentError(
          "a step of " + std::to_string(batch.size()) + " requests and " + std::to_string(rows) +
          " tokens exceeds the GPU cache rank's "
          "data plane (max_runs " +
          std::to_string(limits.max_runs) + ", max_rows " + std::to_string(limits.max_rows) + ")");
    }
    return Status::Ok();
  }

  Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) override {
    RUBATO_RETURN_IF_ERROR(residency_.control_.Health());
    // Runs in the plan's row order: the decode rows first.
    order_.resize(batch.size());
    for (size_t e = 0; e < batch.size(); ++e) order_[e] = e;
    std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) {
      return plan.entry_first_row[a] < plan.entry_first_row[b];
    });
    runs_.clear();
    for (const size_t e : order_) {
      const ForwardEntry& entry = batch[e];
      runs_.push_back({GpuCacheSessionOf(entry), static_cast<uint32_t>(entry.start_position),
                       static_cast<uint32_t>(entry.tokens.size())});
    }
    // The plan's bound of the decode rows' keys fixes the attention grid, as for local dense.
    RUBATO_RETURN_IF_ERROR(
        client_.PlanStep(runs_, plan.decode_rows, plan.decode_max_seq_len, model_stream_));
    residency_.CountSteps();
    return Status::Ok();
  }

  Status LayerComputed(const CudaLayerContext& layer) override {
    return client_.Layer(layer.layer, layer.qkv, layer.attention, layer.stream);
  }

  // A cache rank lost during the step (its data plane aborted under the model's stream
  // waits): the step's attention rows are not the cache rank's.
  Status FinishStep() override { return residency_.control_.Health(); }

  Status AttendDecodeRows(const CudaLayerContext& /*layer*/, int first_row, int rows,
                          const AttentionWindow& /*window*/) override {
    // LayerComputed received rows [0, decode rows): all of them are the residency's.
    if (first_row != 0) {
      return InternalError("GPU cache rank: decode rows from " + std::to_string(first_row) + " (" +
                           std::to_string(rows) + "), expected all from 0");
    }
    return Status::Ok();
  }

 private:
  DeviceCacheRankResidency& residency_;
  DevicePlaneClient& client_;
  cudaStream_t model_stream_ = nullptr;
  std::vector<size_t> order_;
  std::vector<DeviceStepRun> runs_;
};

DeviceCacheRankResidency::DeviceCacheRankResidency(DevicePlaneClient& client,
                                                   DeviceSessionControl& control,
                                                   std::string cache_name)
    : client_(client), control_(control), cache_name_(std::move(cache_name)) {}

Status DeviceCacheRankResidency::Check(const AttentionPolicy* policy) const {
  if (policy == nullptr) return Status::Ok();
  // What the policy asks of a cache rank, by its selector's traits: attention there.
  Result<CacheSelectorSpec> spec = policy->MakeCacheSelector();
  const CacheSelector* selector = spec.ok() ? FindCacheSelector(spec->name) : nullptr;
  if (selector != nullptr && selector->traits().partial_attention) return Status::Ok();
  return UnsupportedError(cache_name_ +
                          " keeps the KV on its GPU (cache.memory: device) and runs attention "
                          "there; policy '" +
                          std::string(policy->name()) +
                          "' selects rows there, which needs a cache rank with cache.memory "
                          "pageable or pinned");
}

Status DeviceCacheRankResidency::Attach(Model& model, const AttentionPolicy* policy,
                                        int max_batch) {
  RUBATO_RETURN_IF_ERROR(Check(policy));
  auto* cuda_model = dynamic_cast<CudaModel*>(&model);
  if (cuda_model == nullptr) {
    return UnsupportedError(cache_name_ +
                            " keeps the KV on its GPU: it needs the CUDA model "
                            "(engine.backend: cuda), not the " +
                            std::string(model.backend_name()) + " model");
  }
  if (max_batch > client_.limits().max_runs) {
    return InvalidArgumentError("engine max_batch " + std::to_string(max_batch) + " exceeds " +
                                cache_name_ + "'s data plane (max_runs " +
                                std::to_string(client_.limits().max_runs) + ")");
  }
  return model.SetResidencyBackend(
      std::make_unique<DeviceCacheRankBackend>(*this, cuda_model->stream()));
}

Result<std::unique_ptr<ResidencyRequest>> DeviceCacheRankResidency::Open(uint64_t request_id,
                                                                         int reserved_tokens) {
  // Positions 0..reserved_tokens: the last sampled token is never fed back.
  Result<uint64_t> session = control_.OpenSession(request_id, reserved_tokens + 1);
  if (!session.ok()) {
    return session.status().WithContext("opening its session on " + cache_name_);
  }
  return std::unique_ptr<ResidencyRequest>(std::make_unique<GpuCacheRequest>(*session));
}

Status DeviceCacheRankResidency::Close(ResidencyRequest& request) {
  return control_.CloseSession(static_cast<GpuCacheRequest&>(request).session());
}

Status DeviceCacheRankResidency::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(CounterFamily * bytes,
                          registry.AddCounterFamily("rubato:transport_bytes_total",
                                                    "Bytes moved between inference and cache "
                                                    "ranks, by the counting rank's role, "
                                                    "direction and transport backend.",
                                                    {"role", "direction", "backend"}));
  RUBATO_ASSIGN_OR_RETURN(bytes_out_metric_, bytes->WithLabels({"inference", "tx", "device"}));
  RUBATO_ASSIGN_OR_RETURN(bytes_back_metric_, bytes->WithLabels({"inference", "rx", "device"}));
  return Status::Ok();
}

void DeviceCacheRankResidency::CountSteps() {
  if (bytes_out_metric_ == nullptr) return;
  bytes_out_metric_->Increment(static_cast<double>(client_.total_bytes_out() - counted_out_));
  bytes_back_metric_->Increment(static_cast<double>(client_.total_bytes_back() - counted_back_));
  counted_out_ = client_.total_bytes_out();
  counted_back_ = client_.total_bytes_back();
}

std::string DeviceCacheRankResidency::StatsLine() const {
  char text[160];
  std::snprintf(text, sizeof(text), " cache_bytes_out=%llu cache_bytes_back=%llu",
                static_cast<unsigned long long>(client_.total_bytes_out()),
                static_cast<unsigned long long>(client_.total_bytes_back()));
  return text;
}

}  // namespace rubato
