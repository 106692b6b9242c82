// The offloaded residency over a GPU cache rank in this process (see gpu_cache_residency.h):
// the engine half (sessions in the cache GPU's store) and the CUDA model half (PlanStep's rows,
// every layer through GpuCacheAttention::Layer).
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/cuda_residency_backend.h"
#include "inference_rank/residency/offloaded/cache_placement.h"
#include "inference_rank/residency/offloaded/gpu_cache_session.h"
#include "inference_rank/residency/offloaded/gpu_cache_topk.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/query_predictor.cuh"

namespace rubato {
namespace {

// The CUDA half over the residency's cache GPUs. An entry with a session is attended on its
// cache GPU; one without (placement keeps it wholly in the model GPU's paged cache) by the
// local dense kernel on the model's stream, while the cache GPUs attend theirs: per layer each
// cache GPU gets its rows' q|k|v after the local append (Send), the model stream attends the
// local decode rows, then waits for every cache GPU's output (Join). Each GPU's launches split
// the keys as one launch over its own decode rows would (a launch sized for the whole batch
// would leave half of each GPU idle when the rows are shared); with `exact_splits` every launch
// uses the whole batch's splits instead, so every row has local dense's bits (the tests).
class GpuCacheCudaBackend final : public CudaResidencyBackend {
 public:
  GpuCacheCudaBackend(std::vector<std::shared_ptr<GpuCacheAttention>> caches,
                      cudaStream_t model_stream, bool exact_splits)
      : caches_(std::move(caches)),
        model_stream_(model_stream),
        rows_(caches_.size()),
        exact_splits_(exact_splits) {}

  std::string_view residency_name() const override { return "offloaded"; }
  bool graph_replayable() const override { return true; }

  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override {
    RUBATO_RETURN_IF_ERROR(CheckGpuCacheBatch(batch, window, /*local_entries=*/true));
    for (size_t e = 0; e < batch.size(); ++e) {
      if (batch[e].residency == nullptr) continue;
      const int cache = static_cast<const GpuCacheSession&>(*batch[e].residency).cache;
      if (cache < 0 || cache >= static_cast<int>(caches_.size())) {
        return InvalidArgumentError("batch entry " + std::to_string(e) + ": cache GPU " +
                                    std::to_string(cache) + " of " +
                                    std::to_string(caches_.size()));
      }
    }
    return Status::Ok();
  }

  Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) override {
    for (std::vector<GpuCacheAttention::Row>& rows : rows_) rows.clear();
    local_runs_.clear();
    // The model rows each cache GPU serves (decode rows first: the plan's rows are), and which
    // rows of the step are whose: -1 the model GPU's, else the cache index.
    std::vector<int> owner(static_cast<size_t>(plan.tokens), -1);
    for (size_t e = 0; e < batch.size(); ++e) {
      const ForwardEntry& entry = batch[e];
      if (entry.residency == nullptr) continue;
      const auto& session = static_cast<const GpuCacheSession&>(*entry.residency);
      const int first = plan.entry_first_row[e];
      for (size_t t = 0; t < entry.tokens.size(); ++t) {
        const int row = first + static_cast<int>(t);
        owner[static_cast<size_t>(row)] = session.cache;
        rows_[static_cast<size_t>(session.cache)].push_back(
            {static_cast<int>(session.session), entry.start_position + static_cast<int>(t), row});
      }
    }
    decode_owner_.assign(owner.begin(), owner.begin() + plan.decode_rows);
    for (int row = 0; row < plan.decode_rows; ++row) {
      if (owner[static_cast<size_t>(row)] >= 0) continue;
      if (!local_runs_.empty() && local_runs_.back().first + local_runs_.back().count == row) {
        ++local_runs_.back().count;
      } else {
        local_runs_.push_back({row, 1});
      }
    }
    // The key splits of one dense launch over the plan's dense decode rows (exact_splits), or
    // over the model GPU's own decode rows. Without dense rows the model never calls
    // AttendDecodeRows: each layer joins at once.
    const int dense_rows = plan.decode_rows - plan.backend_rows;
    join_in_attend_ = dense_rows > 0;
    int local_rows = 0;
    for (const LocalRun& run : local_runs_) local_rows += run.count;
    const auto splits = [&](int rows) {
      return rows > 0 ? cuda::DecodeAttentionDefaultSplits(rows, caches_.front()->num_kv_heads(),
                                                           std::max(plan.decode_max_seq_len, 1))
                      : 0;
    };
    const int whole_batch_splits = splits(dense_rows);
    num_splits_ = exact_splits_ ? whole_batch_splits : splits(local_rows);
    for (size_t c = 0; c < caches_.size(); ++c) {
      std::vector<GpuCacheAttention::Row>& rows = rows_[c];
      if (rows.empty()) continue;
      std::sort(rows.begin(), rows.end(),
                [](const auto& a, const auto& b) { return a.model_row < b.model_row; });
      const int decode =
          static_cast<int>(std::count_if(rows.begin(), rows.end(), [&](const auto& row) {
            return row.model_row < plan.decode_rows;
          }));
      // The plan's bound of the decode rows' keys fixes the attention grid, as for local dense
      // (a captured step keeps it while the sequences grow within the bucket).
      RUBATO_RETURN_IF_ERROR(caches_[c]->PlanStep(
          rows, decode, model_stream_, decode > 0 ? plan.decode_max_seq_len : 0,
          exact_splits_ ? whole_batch_splits : splits(decode)));
    }
    return Status::Ok();
  }

  // A captured step bakes in which decode rows go where (the copies' runs, each side's
  // launches): 4 bits per row (0 the model GPU, 1 + the cache index), the first 112 rows
  // exactly, the rest hashed into the last word. The splits follow from the key's batch and
  // bucket.
  void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& key) const override {
    constexpr size_t kExactRows = 112;
    std::array<uint64_t, 8> words{};
    for (size_t row = 0; row < decode_owner_.size(); ++row) {
      const uint64_t code = static_cast<uint64_t>(decode_owner_[row] + 1) & 0xf;
      if (row < kExactRows) {
        words[row / 16] |= code << (4 * (row % 16));
      } else {
        words[7] = words[7] * 1000003u + code + 1;
      }
    }
    for (size_t i = 0; i < words.size(); ++i) key.policy[i] = static_cast<int64_t>(words[i]);
  }

  Status LayerComputed(const CudaLayerContext& layer) override {
    for (size_t c = 0; c < caches_.size(); ++c) {
      if (rows_[c].empty()) continue;
      RUBATO_RETURN_IF_ERROR(
          caches_[c]->Send(layer.layer, layer.qkv, layer.attention, layer.stream));
      // The cache GPU reads this layer's q|k|v rows, which the next layer overwrites: the model
      // stream waits for it within the layer, after its own attention when it has some.
      if (!join_in_attend_) RUBATO_RETURN_IF_ERROR(caches_[c]->Join(layer.layer, layer.stream));
    }
    return Status::Ok();
  }

  Status AttendDecodeRows(const CudaLayerContext& layer, int first_row, int rows,
                          const AttentionWindow& window) override {
    // The local decode rows, while the cache GPUs attend theirs.
    for (const LocalRun& run : local_runs_) {
      const int begin = std::max(run.first, first_row);
      const int end = std::min(run.first + run.count, first_row + rows);
      if (begin >= end) continue;
      cuda::DecodeAttentionParams dense = layer.DecodeRows(begin, end - begin);
      dense.sink_tokens = window.sink_tokens;
      dense.recent_tokens = window.recent_tokens;
      dense.num_splits = num_splits_;
      RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(dense, layer.stream));
    }
    for (size_t c = 0; c < caches_.size(); ++c) {
      if (!rows_[c].empty()) RUBATO_RETURN_IF_ERROR(caches_[c]->Join(layer.layer, layer.stream));
    }
    return Status::Ok();
  }

 private:
  struct LocalRun {
    int first = 0;
    int count = 0;
  };

  std::vector<std::shared_ptr<GpuCacheAttention>> caches_;
  cudaStream_t model_stream_ = nullptr;
  std::vector<std::vector<GpuCacheAttention::Row>> rows_;  // [cache] the step's, model order
  std::vector<LocalRun> local_runs_;                       // the model GPU's decode rows, in runs
  std::vector<int> decode_owner_;  // [decode rows] -1 local, else the cache index
  int num_splits_ = 0;             // the model GPU's launches'
  bool join_in_attend_ = false;    // the step has dense decode rows: AttendDecodeRows joins
  bool exact_splits_ = false;
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
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(sparse, layer.stream));
    // AsyncSpade: the pack selected ahead goes into the pools once they are read.
    return topk_->AfterAttention(layer.layer, layer.stream);
  }

  // A step ahead (AsyncSpade) has other launches and stream branches than one selected with
  // the step's query.
  void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& key) const override {
    key.policy[0] = topk_->step_ahead() ? 1 : 0;
  }

  Status FinishStep() override { return topk_->FinishStep(); }
  void AbortStep() override { topk_->AbortStep(); }

 private:
  std::shared_ptr<GpuCacheTopK> topk_;
  cudaStream_t model_stream_ = nullptr;
  std::vector<GpuCacheTopK::Entry> entries_;
};

// The selection a policy asks of the cache rank (oracle_topk, or asyncspade: the same selection
// one step ahead with predicted queries), or nothing (dense).
std::optional<CacheSelectorSpec> TopKSelection(const AttentionPolicy* policy) {
  if (policy == nullptr) return std::nullopt;
  Result<CacheSelectorSpec> spec = policy->MakeCacheSelector();
  if (!spec.ok() || (spec->name != "oracle_topk" && spec->name != "asyncspade")) {
    return std::nullopt;
  }
  return *spec;
}

}  // namespace

GpuCacheResidency::GpuCacheResidency(const CacheSection& cache, int max_context, int max_step_rows,
                                     int block_tokens, std::vector<int> cache_devices)
    : cache_(cache),
      max_context_(max_context),
      max_step_rows_(max_step_rows),
      block_tokens_(block_tokens),
      cache_devices_(std::move(cache_devices)) {}

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
    if (cache_devices_.size() > 1 || local_window_ == 0) {
      return UnsupportedError(
          selection->name +
          " on a GPU cache rank of this process: one cache GPU and every request "
          "offloaded (several cache GPUs and placement serve dense attention only)");
    }
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
    options.predict = selection->name == "asyncspade";
    options.query_window = selection->query_window;
    options.ridge_lambda = selection->ridge_lambda;
    options.dense_steps = selection->dense_steps;
    if (options.predict && options.query_window > cuda::kDeviceQueryWindowMax) {
      return UnsupportedError("policy asyncspade on a GPU cache rank: query_window " +
                              std::to_string(options.query_window) + " exceeds the " +
                              std::to_string(cuda::kDeviceQueryWindowMax) +
                              " the device predictor takes");
    }
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<GpuCacheTopK> made,
                            GpuCacheTopK::Create(model.config(), options));
    topk_ = std::move(made);
    ObserveSteps();
    return model.SetResidencyBackend(
        std::make_unique<GpuCacheTopKCudaBackend>(topk_, cuda_model->stream()));
  }
  std::vector<int> devices = cache_devices_;
  if (devices.empty()) devices.push_back(cache_.device);
  caches_.clear();
  for (const int device : devices) {
    GpuCacheAttentionOptions options;
    options.model_device = cuda_model->device();
    options.cache_device = device >= 0 ? device : options.model_device;
    options.budget_bytes = cache_.budget_bytes();
    options.max_context = max_context_;
    options.max_rows = std::max(max_step_rows_, max_batch);
    options.block_tokens = block_tokens_;
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<GpuCacheAttention> made,
                            GpuCacheAttention::Create(model.config(), options));
    caches_.push_back(std::move(made));
  }
  ObserveSteps();  // metrics registered before Attach
  return model.SetResidencyBackend(
      std::make_unique<GpuCacheCudaBackend>(caches_, cuda_model->stream(), exact_splits_));
}

Result<std::unique_ptr<ResidencyRequest>> GpuCacheResidency::Open(uint64_t request_id,
                                                                  int reserved_tokens) {
  if (topk_ != nullptr) {
    Result<int> session = topk_->OpenSession(request_id, reserved_tokens + 1);
    if (!session.ok()) return session.status().WithContext("opening its GPU cache-rank session");
    return std::unique_ptr<ResidencyRequest>(std::make_unique<GpuCacheRequest>(*session));
  }
  if (caches_.empty()) return FailedPreconditionError("GPU cache rank: not attached");
  // The cache GPU with the most free blocks (ties to the lower index): the placement rule of
  // several cache ranks (cache_placement.h).
  std::vector<CacheRankBudget> budgets;
  for (const auto& cache : caches_) {
    budgets.push_back({true, static_cast<uint64_t>(cache->free_blocks())});
  }
  const int pick = PickCacheRank(budgets);
  // Positions 0..reserved_tokens: the last sampled token is never fed back.
  Result<int> session = caches_[static_cast<size_t>(pick)]->OpenSession(reserved_tokens + 1);
  if (!session.ok()) return session.status().WithContext("opening its GPU cache-rank session");
  if (device_bytes_metric_ != nullptr)
    device_bytes_metric_->Set(static_cast<double>(device_bytes()));
  return std::unique_ptr<ResidencyRequest>(std::make_unique<GpuCacheRequest>(*session, pick));
}

Status GpuCacheResidency::Close(ResidencyRequest& request) {
  if (topk_ != nullptr) {
    return topk_->CloseSession(static_cast<int>(static_cast<GpuCacheRequest&>(request).session()));
  }
  const auto& gpu_request = static_cast<GpuCacheRequest&>(request);
  return caches_[static_cast<size_t>(gpu_request.cache())]->CloseSession(
      static_cast<int>(gpu_request.session()));
}

size_t GpuCacheResidency::device_bytes() const {
  size_t bytes = 0;
  for (const auto& cache : caches_) bytes += cache->device_bytes();
  return bytes;
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
  if (caches_.empty() || bytes_out_metric_ == nullptr) return;
  device_bytes_metric_->Set(static_cast<double>(device_bytes()));
  Counter* out = bytes_out_metric_;
  Counter* back = bytes_back_metric_;
  for (const auto& cache : caches_) {
    cache->SetStepObserver([out, back](size_t bytes_out, size_t bytes_back) {
      out->Increment(static_cast<double>(bytes_out));
      back->Increment(static_cast<double>(bytes_back));
    });
  }
}

std::string GpuCacheResidency::StatsLine() const {
  if (topk_ != nullptr) {
    // The client's names (offloaded_residency.cc) where they mean the same.
    const GpuCacheTopKBytes& t = topk_->totals();
    const double steps = static_cast<double>(std::max<uint64_t>(topk_->steps(), 1));
    char ahead[160] = "";
    if (topk_->options().predict) {
      std::snprintf(ahead, sizeof(ahead),
                    " predicted_steps=%llu step_wait_ms=%.3f total_wait_ms=%.3f",
                    static_cast<unsigned long long>(topk_->predicted_steps()),
                    topk_->total_wait_ms() / steps, topk_->total_wait_ms());
    }
    char text[560];
    std::snprintf(text, sizeof(text),
                  " cache_bytes_out=%llu cache_bytes_back=%llu cache_device_mib=%.0f "
                  "offload_steps=%llu step_bytes_sent=%.0f step_bytes_received=%.0f "
                  "delta_replies=%d compact_rows_received=%llu compact_rows_full=%llu "
                  "step_full_reply_bytes=%.0f%s",
                  static_cast<unsigned long long>(t.out), static_cast<unsigned long long>(t.back),
                  topk_->cache_device_bytes() / 1048576.0,
                  static_cast<unsigned long long>(topk_->steps()), t.out / steps, t.back / steps,
                  topk_->delta_replies() ? 1 : 0, static_cast<unsigned long long>(t.rows_back),
                  static_cast<unsigned long long>(t.rows_full), t.full_back / steps, ahead);
    return text;
  }
  if (caches_.empty()) return "";
  uint64_t out = 0, back = 0;
  for (const auto& cache : caches_) {
    out += cache->total_bytes_out();
    back += cache->total_bytes_back();
  }
  char text[200];
  std::snprintf(text, sizeof(text),
                " cache_bytes_out=%llu cache_bytes_back=%llu cache_device_mib=%.0f",
                static_cast<unsigned long long>(out), static_cast<unsigned long long>(back),
                device_bytes() / 1048576.0);
  return text;
}

}  // namespace rubato
