// The offloaded residency over a GPU cache rank in this process (see gpu_cache_residency.h):
// the engine half (sessions in the cache GPU's store) and the CUDA model half (PlanStep's rows,
// every layer through GpuCacheAttention::Layer).
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/cuda_residency_backend.h"
#include "inference_rank/residency/offloaded/gpu_cache_session.h"
#include "inference_rank/residency/offloaded/gpu_cache_topk.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"
#include "kernels/cuda/decode_attention.cuh"

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

// The CUDA half of oracle_topk on the cache GPU: every layer's rows go there, its delta pack
// comes back into the compact pools, and the decode rows attend the pools and their recent
// window in place (GpuCacheTopK).
class GpuCacheTopKCudaBackend final : public CudaResidencyBackend {
 public:
  GpuCacheTopKCudaBackend(std::shared_ptr<GpuCacheTopK> topk, cudaStream_t model_stream)
      : topk_(std::move(topk)), model_stream_(model_stream) {}

  std::string_view residency_name() const override { return "offloaded"; }
  bool graph_replayable() const override { return true; }

  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override {
    return CheckGpuCacheBatch(batch, window);
  }

  Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) override {
    // Decode entries first, in row order (entry i at row i), then the chunks.
    entries_.clear();
    int rows = 0;
    for (size_t e = 0; e < batch.size(); ++e) {
      const int first = plan.entry_first_row[e];
      const int tokens = static_cast<int>(batch[e].tokens.size());
      rows = std::max(rows, first + tokens);
      entries_.push_back(
          {static_cast<int>(GpuCacheSessionOf(batch[e])), batch[e].start_position, tokens, first});
    }
    std::stable_sort(entries_.begin(), entries_.end(),
                     [](const GpuCacheTopK::Entry& a, const GpuCacheTopK::Entry& b) {
                       return a.first_row < b.first_row;
                     });
    int decode = 0;
    while (decode < static_cast<int>(entries_.size()) &&
           entries_[static_cast<size_t>(decode)].first_row < plan.decode_rows) {
      ++decode;
    }
    return topk_->PlanStep(entries_, decode, rows, model_stream_, plan.decode_max_seq_len);
  }

  Status LayerComputed(const CudaLayerContext& layer) override {
    return topk_->Layer(layer.layer, layer.qkv, layer.stream);
  }

  Status AttendDecodeRows(const CudaLayerContext& layer, int first_row, int rows,
                          const AttentionWindow& /*window*/) override {
    if (first_row != 0) {
      return InternalError("GPU cache top-k: decode rows from " + std::to_string(first_row) + " (" +
                           std::to_string(rows) + "), expected all from 0");
    }
    // Local oracle_topk's second launch: compact rows (here the pools), then the recent window.
    cuda::DecodeAttentionParams sparse = layer.DecodeRows(0, rows);
    topk_->SetAttention(layer.layer, sparse);
    return cuda::DecodeAttention(sparse, layer.stream);
  }

  Status FinishStep() override { return topk_->FinishStep(); }
  void AbortStep() override { topk_->AbortStep(); }

 private:
  std::shared_ptr<GpuCacheTopK> topk_;
  cudaStream_t model_stream_ = nullptr;
  std::vector<GpuCacheTopK::Entry> entries_;
};

// The oracle_topk selection a policy asks of the cache rank, or nothing (dense).
std::optional<CacheSelectorSpec> TopKSelection(const AttentionPolicy* policy) {
  if (policy == nullptr) return std::nullopt;
  Result<CacheSelectorSpec> spec = policy->MakeCacheSelector();
  if (!spec.ok() || spec->name != "oracle_topk") return std::nullopt;
  return *spec;
}

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
  if (const std::optional<CacheSelectorSpec> selection = TopKSelection(policy)) {
    GpuCacheTopKOptions options;
    options.model_device = cuda_model->device();
    options.cache_device = cache_.device >= 0 ? cache_.device : options.model_device;
    options.block_tokens = block_tokens_;
    options.budget_bytes = cache_.budget_bytes();
    options.max_rows = std::max(max_step_rows_, max_batch);
    options.max_requests = max_batch;
    options.max_context = max_context_;
    options.top_k = selection->top_k;
    options.sink_tokens = selection->sink_tokens;
    options.recent_tokens = selection->recent_tokens;
    options.delta_replies = delta_replies_;
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<GpuCacheTopK> made,
                            GpuCacheTopK::Create(model.config(), options));
    topk_ = std::move(made);
    ObserveSteps();
    return model.SetResidencyBackend(
        std::make_unique<GpuCacheTopKCudaBackend>(topk_, cuda_model->stream()));
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

Result<std::unique_ptr<ResidencyRequest>> GpuCacheResidency::Open(uint64_t request_id,
                                                                  int reserved_tokens) {
  if (topk_ != nullptr) {
    Result<int> session = topk_->OpenSession(request_id, reserved_tokens + 1);
    if (!session.ok()) return session.status().WithContext("opening its GPU cache-rank session");
    return std::unique_ptr<ResidencyRequest>(std::make_unique<GpuCacheRequest>(*session));
  }
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
  if (topk_ != nullptr) {
    return topk_->CloseSession(static_cast<int>(static_cast<GpuCacheRequest&>(request).session()));
  }
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
  if (topk_ != nullptr && bytes_out_metric_ != nullptr) {
    device_bytes_metric_->Set(static_cast<double>(topk_->cache_device_bytes()));
    Counter* out = bytes_out_metric_;
    Counter* back = bytes_back_metric_;
    topk_->SetStepObserver([out, back](const GpuCacheTopKBytes& step) {
      out->Increment(static_cast<double>(step.out));
      back->Increment(static_cast<double>(step.back));
    });
    return;
  }
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
  if (topk_ != nullptr) {
    // The client's names (offloaded_residency.cc) where they mean the same.
    const GpuCacheTopKBytes& t = topk_->totals();
    const double steps = static_cast<double>(std::max<uint64_t>(topk_->steps(), 1));
    char text[400];
    std::snprintf(text, sizeof(text),
                  " cache_bytes_out=%llu cache_bytes_back=%llu cache_device_mib=%.0f "
                  "offload_steps=%llu step_bytes_sent=%.0f step_bytes_received=%.0f "
                  "delta_replies=%d compact_rows_received=%llu compact_rows_full=%llu "
                  "step_full_reply_bytes=%.0f",
                  static_cast<unsigned long long>(t.out), static_cast<unsigned long long>(t.back),
                  topk_->cache_device_bytes() / 1048576.0,
                  static_cast<unsigned long long>(topk_->steps()), t.out / steps, t.back / steps,
                  topk_->delta_replies() ? 1 : 0, static_cast<unsigned long long>(t.rows_back),
                  static_cast<unsigned long long>(t.rows_full), t.full_back / steps);
    return text;
  }
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
