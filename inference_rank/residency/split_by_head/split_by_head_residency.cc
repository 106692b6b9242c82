// The split_by_head residency's engine half (see split_by_head_residency.h).
#include "inference_rank/residency/split_by_head/split_by_head_residency.h"

#include <cstdio>

#include "inference_rank/residency/split_by_head/split_by_head_cpu_backend.h"
#ifdef RUBATO_HAS_CUDA
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/split_by_head/split_by_head_cuda_backend.h"
#endif

namespace rubato {
namespace {

class SplitByHeadRequest final : public ResidencyRequest {
 public:
  SplitByHeadRequest(const HeadSplit& split, int head_dim, int capacity, KvFetcher& fetcher,
                     SplitByHeadCounters& counters)
      : kv_(split, head_dim, capacity, fetcher, counters) {
    entry_.kv = &kv_;
  }
  void AttachTo(ForwardEntry& entry) const override { entry.residency = &entry_; }

 private:
  SplitByHeadKv kv_;
  SplitByHeadEntry entry_;
};

#ifdef RUBATO_HAS_CUDA
// A request on the CUDA model: a slot of the device storage, given back at Close.
class SplitByHeadCudaResidencyRequest final : public ResidencyRequest {
 public:
  SplitByHeadCudaResidencyRequest(std::shared_ptr<SplitByHeadDeviceKv> kv, int slot)
      : kv_(std::move(kv)) {
    request_.kv = kv_.get();
    request_.slot = slot;
    entry_.request = &request_;
  }
  void AttachTo(ForwardEntry& entry) const override { entry.residency = &entry_; }
  void Release() {
    if (request_.slot >= 0) kv_->ReleaseSlot(request_.slot);
    request_.slot = -1;
  }
  ~SplitByHeadCudaResidencyRequest() override { Release(); }

 private:
  std::shared_ptr<SplitByHeadDeviceKv> kv_;
  SplitByHeadCudaRequest request_;
  SplitByHeadCudaEntry entry_;
};
#endif

}  // namespace

SplitByHeadResidency::SplitByHeadResidency(std::shared_ptr<KvFetcher> fetcher, int context_capacity)
    : fetcher_(fetcher != nullptr ? std::move(fetcher)
                                  : std::shared_ptr<KvFetcher>(MakeThreadKvFetcher())),
      context_capacity_(context_capacity) {}

SplitByHeadResidency::~SplitByHeadResidency() = default;

Status SplitByHeadResidency::Check(const AttentionPolicy* policy) const {
  if (dynamic_cast<const HeadSplitPolicy*>(policy) == nullptr) {
    return InvalidArgumentError(
        "engine.kv_residency: split_by_head needs a policy that names representative heads "
        "(synckv); policy '" +
        std::string(policy != nullptr ? policy->name() : "dense") + "' names none");
  }
  return Status::Ok();
}

Status SplitByHeadResidency::Attach(Model& model, const AttentionPolicy* policy, int max_batch) {
  RUBATO_RETURN_IF_ERROR(Check(policy));
  if (model.backend_name() != "cpu" && model.backend_name() != "cuda") {
    return UnsupportedError(
        "engine.kv_residency: split_by_head is built for the CPU and CUDA "
        "models, not the " +
        std::string(model.backend_name()) + " model");
  }
  const auto& head_policy = *dynamic_cast<const HeadSplitPolicy*>(policy);
  const HeadSplit& split = head_policy.head_split();
  const ModelConfig& config = model.config();
  if (split.num_layers != config.num_layers || split.num_kv_heads != config.num_kv_heads) {
    return InvalidArgumentError(
        "split_by_head: the policy's head split is for " + std::to_string(split.num_layers) +
        " layers x " + std::to_string(split.num_kv_heads) + " KV heads, the model has " +
        std::to_string(config.num_layers) + " x " + std::to_string(config.num_kv_heads));
  }
  split_ = &split;
  head_dim_ = config.head_dim;
  if (model.backend_name() == "cuda") {
#ifdef RUBATO_HAS_CUDA
    const int capacity = context_capacity_ > 0 ? context_capacity_ : config.max_position_embeddings;
    RUBATO_ASSIGN_OR_RETURN(
        std::unique_ptr<SplitByHeadDeviceKv> kv,
        SplitByHeadDeviceKv::Create(split, config, static_cast<CudaModel&>(model).device(),
                                    max_batch, capacity, head_policy.KeptPositions(capacity),
                                    head_policy.store()));
    kv->counters = counters_.get();
    device_kv_ = std::move(kv);
    local_window_ = head_policy.RecentPositions() + 64;  // the two-segment kernel's tile
    return model.SetResidencyBackend(
        std::make_unique<SplitByHeadCudaBackend>(device_kv_, config, *counters_, metrics_));
#else
    return UnsupportedError(
        "engine.kv_residency: split_by_head on the CUDA model needs a build "
        "with RUBATO_CUDA");
#endif
  }
  return model.SetResidencyBackend(
      std::make_unique<SplitByHeadCpuBackend>(split, *counters_, metrics_));
}

Result<std::unique_ptr<ResidencyRequest>> SplitByHeadResidency::Open(uint64_t /*request_id*/,
                                                                     int reserved_tokens) {
  if (split_ == nullptr) return FailedPreconditionError("split_by_head: Open before Attach");
#ifdef RUBATO_HAS_CUDA
  if (device_kv_ != nullptr) {
    if (reserved_tokens + 1 > device_kv_->context_capacity()) {
      return ResourceExhaustedError(
          "split_by_head: a request of " + std::to_string(reserved_tokens + 1) +
          " positions exceeds the device storage's " +
          std::to_string(device_kv_->context_capacity()) + " (engine.max_context)");
    }
    const int slot = device_kv_->AcquireSlot();
    if (slot < 0) {
      return ResourceExhaustedError("split_by_head: every device slot (engine.max_batch) is held");
    }
    return std::unique_ptr<ResidencyRequest>(
        std::make_unique<SplitByHeadCudaResidencyRequest>(device_kv_, slot));
  }
#endif
  // reserved_tokens: every position the paged cache holds, which is every position forwarded.
  return std::unique_ptr<ResidencyRequest>(std::make_unique<SplitByHeadRequest>(
      *split_, head_dim_, std::max(1, reserved_tokens), *fetcher_, *counters_));
}

Status SplitByHeadResidency::Close(ResidencyRequest& request) {
#ifdef RUBATO_HAS_CUDA
  if (auto* cuda = dynamic_cast<SplitByHeadCudaResidencyRequest*>(&request)) cuda->Release();
#else
  (void)request;
#endif
  return Status::Ok();
}

size_t SplitByHeadResidency::device_bytes() const {
#ifdef RUBATO_HAS_CUDA
  if (device_kv_ != nullptr) return device_kv_->device_bytes();
#endif
  return 0;
}

Status SplitByHeadResidency::CheckRedo() const {
  return FailedPreconditionError(
      "split_by_head KV: a step cannot be redone (its rows went to the offloaded store and its "
      "anticipation may have started a fetch)");
}

Status SplitByHeadResidency::RegisterMetrics(MetricsRegistry& registry) {
  RUBATO_ASSIGN_OR_RETURN(metrics_.fetches,
                          registry.AddCounter("rubato:split_by_head_fetches_total",
                                              "Anticipation fetches, per request and layer."));
  RUBATO_ASSIGN_OR_RETURN(
      metrics_.rows_fetched,
      registry.AddCounter("rubato:split_by_head_rows_fetched_total",
                          "NR-head KV rows fetched from the offloaded store (the delta: rows "
                          "already local are not fetched)."));
  RUBATO_ASSIGN_OR_RETURN(metrics_.bytes_fetched,
                          registry.AddCounter("rubato:split_by_head_bytes_fetched_total",
                                              "K and V bytes of the rows fetched."));
  RUBATO_ASSIGN_OR_RETURN(
      metrics_.exposed_wait_seconds,
      registry.AddCounter("rubato:split_by_head_exposed_fetch_wait_seconds_total",
                          "Time steps waited for a fetch that had not arrived."));
  RUBATO_ASSIGN_OR_RETURN(
      metrics_.local_kv_share,
      registry.AddGauge("rubato:split_by_head_local_kv_share",
                        "The last step's local KV bytes over the full KV of its requests."));
  return Status::Ok();
}

std::string SplitByHeadResidency::StatsLine() const {
  const SplitByHeadCounters& c = *counters_;
  char share[32] = "-";
  if (c.full_kv_bytes > 0) {
    std::snprintf(share, sizeof(share), "%.3f",
                  static_cast<double>(c.local_kv_bytes) / static_cast<double>(c.full_kv_bytes));
  }
  char wait[32];
  std::snprintf(wait, sizeof(wait), "%.3f", static_cast<double>(c.exposed_wait_ns) * 1e-9);
  return " split_by_head_fetches=" + std::to_string(c.fetches) +
         " split_by_head_rows_fetched=" + std::to_string(c.rows_fetched) +
         " split_by_head_bytes_fetched=" + std::to_string(c.bytes_fetched) +
         " split_by_head_rows_reused=" + std::to_string(c.rows_reused) +
         " split_by_head_exposed_wait_s=" + wait + " split_by_head_local_kv_share=" + share;
}

Result<std::shared_ptr<Residency>> CreateSplitByHeadResidency(const ResidencySetup& setup) {
  const int capacity = setup.config != nullptr ? setup.config->engine.max_context : 0;
  return std::shared_ptr<Residency>(std::make_shared<SplitByHeadResidency>(nullptr, capacity));
}

}  // namespace rubato
