// The offloaded residency over a GPU cache rank in this process (see gpu_cache_residency.h):
// the engine half (sessions in the cache GPU's store) and the CUDA model half (PlanStep's rows,
// every layer through GpuCacheAttention::Layer).
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/cuda_residency_backend.h"
#include "inference_rank/residency/offloaded/gpu_cache_session.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"

namespace rubato {
namespace {

// The CUDA half: every row of the step is the residency's (an offloaded engine offloads every
// request), so every decode row's attention comes from the cache GPU.
class GpuCacheCudaBackend final : public CudaResidencyBackend {
 public:
  GpuCacheCudaBackend(std::shared_ptr<GpuCacheAttention> attention, cudaStream_t model_stream)
      : attention_(std::move(attention)), model_stream_(model_stream) {}

  std::string_view residency_name() const override { return "offloaded"; }
  bool graph_replayable() const override { return true; }

  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override {
    return CheckGpuCacheBatch(batch, window);
  }

  Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) override {
    rows_.resize(static_cast<size_t>(plan.entry_first_row.empty() ? 0 : TotalRows(batch)));
    for (size_t e = 0; e < batch.size(); ++e) {
      const ForwardEntry& entry = batch[e];
      const int session = static_cast<int>(GpuCacheSessionOf(entry));
      const int first = plan.entry_first_row[e];
      for (size_t t = 0; t < entry.tokens.size(); ++t) {
        rows_[static_cast<size_t>(first) + t] = {session,
                                                 entry.start_position + static_cast<int>(t)};
      }
    }
    // The plan's bound of the decode rows' keys fixes the attention grid, as for local dense
    // (a captured step keeps it while the sequences grow within the bucket).
    return attention_->PlanStep(rows_, plan.decode_rows, model_stream_, plan.decode_max_seq_len);
  }

  Status LayerComputed(const CudaLayerContext& layer) override {
    return attention_->Layer(layer.layer, layer.qkv, layer.attention, layer.stream);
  }

  Status AttendDecodeRows(const CudaLayerContext& /*layer*/, int first_row, int rows,
                          const AttentionWindow& /*window*/) override {
    // LayerComputed wrote rows [0, decode rows): all of them are the residency's.
    if (first_row != 0) {
      return InternalError("GPU cache rank: decode rows from " + std::to_string(first_row) + " (" +
                           std::to_string(rows) + "), expected all from 0");
    }
    return Status::Ok();
  }

 private:
  static int TotalRows(std::span<const ForwardEntry> batch) {
    int rows = 0;
    for (const ForwardEntry& entry : batch) rows += static_cast<int>(entry.tokens.size());
    return rows;
  }

  std::shared_ptr<GpuCacheAttention> attention_;
  cudaStream_t model_stream_ = nullptr;
  std::vector<GpuCacheAttention::Row> rows_;  // the step's, in the plan's row order
};

}  // namespace

GpuCacheResidency::GpuCacheResidency(const CacheSection& cache, int max_context, int max_step_rows,
                                     int block_tokens)
    : cache_(cache),
      max_context_(max_context),
      max_step_rows_(max_step_rows),
      block_tokens_(block_tokens) {}

Status GpuCacheResidency::Check(const AttentionPolicy* policy) const {
  return CheckGpuCachePolicy(policy);
}

Status GpuCacheResidency::Attach(Model& model, const AttentionPolicy* policy, int max_batch) {
  RUBATO_RETURN_IF_ERROR(Check(policy));
  auto* cuda_model = dynamic_cast<CudaModel*>(&model);
  if (cuda_model == nullptr) {
    return UnsupportedError(
        "cache.memory: device needs the CUDA model (engine.backend: cuda), "
        "not the " +
        std::string(model.backend_name()) + " model");
  }
  GpuCacheAttentionOptions options;
  options.model_device = cuda_model->device();
  options.cache_device = cache_.device >= 0 ? cache_.device : options.model_device;
  options.budget_bytes = cache_.budget_bytes();
  options.max_context = max_context_;
  options.max_rows = std::max(max_step_rows_, max_batch);
  options.block_tokens = block_tokens_;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<GpuCacheAttention> made,
                          GpuCacheAttention::Create(model.config(), options));
  attention_ = std::move(made);
  ObserveSteps();  // metrics registered before Attach
  return model.SetResidencyBackend(
      std::make_unique<GpuCacheCudaBackend>(attention_, cuda_model->stream()));
}

Result<std::unique_ptr<ResidencyRequest>> GpuCacheResidency::Open(uint64_t /*request_id*/,
                                                                  int reserved_tokens) {
  if (attention_ == nullptr) return FailedPreconditionError("GPU cache rank: not attached");
  // Positions 0..reserved_tokens: the last sampled token is never fed back.
  Result<int> session = attention_->OpenSession(reserved_tokens + 1);
  if (!session.ok()) return session.status().WithContext("opening its GPU cache-rank session");
  if (device_bytes_metric_ != nullptr) {
    device_bytes_metric_->Set(static_cast<double>(attention_->device_bytes()));
  }
  return std::unique_ptr<ResidencyRequest>(std::make_unique<GpuCacheRequest>(*session));
}

Status GpuCacheResidency::Close(ResidencyRequest& request) {
  return attention_->CloseSession(
      static_cast<int>(static_cast<GpuCacheRequest&>(request).session()));
}

Status GpuCacheResidency::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(CounterFamily * bytes,
                          registry.AddCounterFamily("rubato:transport_bytes_total",
                                                    "Bytes moved between inference and cache "
                                                    "ranks, by the counting rank's role, "
                                                    "direction and transport backend.",
                                                    {"role", "direction", "backend"}));
  RUBATO_ASSIGN_OR_RETURN(bytes_out_metric_, bytes->WithLabels({"inference", "tx", "device"}));
  RUBATO_ASSIGN_OR_RETURN(bytes_back_metric_, bytes->WithLabels({"inference", "rx", "device"}));
  RUBATO_ASSIGN_OR_RETURN(GaugeFamily * memory,
                          registry.AddGaugeFamily("rubato:cache_rank_memory_bytes",
                                                  "KV storage of this cache rank: reserved by "
                                                  "open sessions, and the budget.",
                                                  {"kind"}));
  RUBATO_ASSIGN_OR_RETURN(device_bytes_metric_, memory->WithLabels({"device"}));
  ObserveSteps();
  return Status::Ok();
}

void GpuCacheResidency::ObserveSteps() {
  if (attention_ == nullptr || bytes_out_metric_ == nullptr) return;
  device_bytes_metric_->Set(static_cast<double>(attention_->device_bytes()));
  Counter* out = bytes_out_metric_;
  Counter* back = bytes_back_metric_;
  attention_->SetStepObserver([out, back](size_t bytes_out, size_t bytes_back) {
    out->Increment(static_cast<double>(bytes_out));
    back->Increment(static_cast<double>(bytes_back));
  });
}

std::string GpuCacheResidency::StatsLine() const {
  if (attention_ == nullptr) return "";
  char text[200];
  std::snprintf(text, sizeof(text),
                " cache_bytes_out=%llu cache_bytes_back=%llu cache_device_mib=%.0f",
                static_cast<unsigned long long>(attention_->total_bytes_out()),
                static_cast<unsigned long long>(attention_->total_bytes_back()),
                attention_->device_bytes() / 1048576.0);
  return text;
}

}  // namespace rubato
