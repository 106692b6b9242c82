// The offloaded residency over GPU cache ranks reached by the device data plane
// (device_cache_rank_residency.h): the engine half (placement, sessions through
// DeviceSessionControl) and the CUDA half with one cache rank (the step's runs, every layer
// through DevicePlaneClient::Layer); with several, device_cache_ranks_backend.cc; reconnecting
// a lost rank, device_cache_rank_reconnect.cc.
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/cuda_residency_backend.h"
#include "inference_rank/residency/offloaded/cache_placement.h"
#include "inference_rank/residency/offloaded/device_cache_ranks_backend.h"
#include "inference_rank/residency/offloaded/gpu_cache_session.h"

namespace rubato {

// The CUDA half: every row of the step is the residency's (an offloaded engine offloads every
// request), so every decode row's attention comes from the cache rank.
class DeviceCacheRankBackend final : public CudaResidencyBackend {
 public:
  DeviceCacheRankBackend(DeviceCacheRankResidency& residency, cudaStream_t model_stream)
      : residency_(residency), model_stream_(model_stream) {}

  std::string_view residency_name() const override { return "offloaded"; }
  bool graph_replayable() const override { return client().capturable(); }

  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override {
    return CheckDevicePlaneBatch(batch, window, client().limits());
  }

  Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) override {
    RUBATO_RETURN_IF_ERROR(residency_.Broken());
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
        client().PlanStep(runs_, plan.decode_rows, plan.decode_max_seq_len, model_stream_));
    residency_.CountSteps();
    return Status::Ok();
  }

  // The rows are in the key already; the connection is not.
  void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& key) const override {
    key.policy[0] = residency_.GraphKeySlot(0, 0, 0);
  }

  Status LayerComputed(const CudaLayerContext& layer) override {
    return client().Layer(layer.layer, layer.qkv, layer.attention, layer.stream);
  }

  // A cache rank lost during the step (its data plane aborted under the model's stream
  // waits): the step's attention rows are not the cache rank's.
  Status FinishStep() override { return residency_.Broken(); }

  // LayerComputed received rows [0, decode rows): all of them are the residency's.
  Status AttendDecodeRows(const CudaLayerContext& /*layer*/, int first_row, int rows,
                          const AttentionWindow& /*window*/) override {
    return CheckDecodeRowsFromZero(first_row, rows);
  }

 private:
  // The current connection's (a reconnect replaces it between steps).
  DevicePlaneClient& client() const { return *residency_.ranks_[0].client; }

  DeviceCacheRankResidency& residency_;
  cudaStream_t model_stream_ = nullptr;
  std::vector<size_t> order_;
  std::vector<DeviceStepRun> runs_;
};

namespace {

std::vector<DeviceCacheRankPeer> OnePeer(DevicePlaneClient& client, DeviceSessionControl& control,
                                         std::string name) {
  std::vector<DeviceCacheRankPeer> peers;
  peers.push_back({&client, &control, std::move(name)});
  return peers;
}

}  // namespace

DeviceCacheRankResidency::DeviceCacheRankResidency(DevicePlaneClient& client,
                                                   DeviceSessionControl& control,
                                                   std::string cache_name)
    : DeviceCacheRankResidency(OnePeer(client, control, std::move(cache_name))) {}

DeviceCacheRankResidency::DeviceCacheRankResidency(std::vector<DeviceCacheRankPeer> ranks,
                                                   ReconnectBackoff backoff)
    : ranks_(std::move(ranks)),
      backoff_(backoff),
      generation_(ranks_.size(), 0),
      failed_(ranks_.size()),
      open_(ranks_.size(), 0),
      ready_(ranks_.size()) {
  bool reconnects = false;
  for (DeviceCacheRankPeer& rank : ranks_) {
    if (rank.owned != nullptr) rank.control = rank.owned.get();
    reconnects = reconnects || rank.reconnect != nullptr;
  }
  if (reconnects) watcher_ = std::thread([this] { Watch(); });
}

DeviceCacheRankResidency::~DeviceCacheRankResidency() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  abandon_ = true;  // an attempt in progress gives up instead of waiting out a stalled peer
  wake_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

Status DeviceCacheRankResidency::Check(const AttentionPolicy* policy) const {
  if (ranks_.empty()) return InvalidArgumentError("the offloaded residency has no cache rank");
  if (policy == nullptr) return Status::Ok();
  // What the policy asks of a cache rank, by its selector's traits: attention there.
  Result<CacheSelectorSpec> spec = policy->MakeCacheSelector();
  const CacheSelector* selector = spec.ok() ? FindCacheSelector(spec->name) : nullptr;
  if (selector != nullptr && selector->traits().partial_attention) return Status::Ok();
  return UnsupportedError(ranks_[0].name +
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
    return UnsupportedError(ranks_[0].name +
                            " keeps the KV on its GPU: it needs the CUDA model "
                            "(engine.backend: cuda), not the " +
                            std::string(model.backend_name()) + " model");
  }
  for (const DeviceCacheRankPeer& rank : ranks_) {
    const DevicePlaneLimits& limits = rank.client->limits();
    if (limits.max_rows != ranks_[0].client->limits().max_rows ||
        limits.max_runs != ranks_[0].client->limits().max_runs) {
      return InvalidArgumentError(rank.name + "'s data plane limits differ from " + ranks_[0].name +
                                  "'s");
    }
    if (max_batch > rank.client->limits().max_runs) {
      return InvalidArgumentError("engine max_batch " + std::to_string(max_batch) + " exceeds " +
                                  rank.name + "'s data plane (max_runs " +
                                  std::to_string(rank.client->limits().max_runs) + ")");
    }
  }
  if (ranks_.size() == 1) {
    return model.SetResidencyBackend(
        std::make_unique<DeviceCacheRankBackend>(*this, cuda_model->stream()));
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<CudaResidencyBackend> backend,
                          MakeDeviceCacheRanksBackend(*this, *cuda_model));
  return model.SetResidencyBackend(std::move(backend));
}

Result<std::unique_ptr<ResidencyRequest>> DeviceCacheRankResidency::Open(uint64_t request_id,
                                                                         int reserved_tokens) {
  InstallReconnected();
  // With several ranks, the one with the most free budget: one FreeBytes call per working rank.
  int rank = 0;
  if (ranks_.size() == 1) {
    const Status lost = RankLost(0);
    if (!lost.ok()) return lost.WithContext("opening its session on " + ranks_[0].name);
  } else {
    std::vector<CacheRankBudget> budgets(ranks_.size());
    std::string why_none;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Status lost = RankLost(static_cast<int>(r));
      if (lost.ok()) {
        const Result<uint64_t> free_bytes = ranks_[r].control->FreeBytes();
        if (free_bytes.ok()) budgets[r] = {true, *free_bytes};
        if (!free_bytes.ok()) lost = free_bytes.status().WithContext(ranks_[r].name);
      }
      if (!lost.ok()) why_none += (why_none.empty() ? "" : "; ") + lost.message();
    }
    rank = PickCacheRank(budgets);
    if (rank < 0) {
      return UnavailableError("no cache rank can take request " + std::to_string(request_id) +
                              ": " + why_none);
    }
  }
  const DeviceCacheRankPeer& peer = ranks_[static_cast<size_t>(rank)];
  // Positions 0..reserved_tokens: the last sampled token is never fed back.
  Result<uint64_t> session = peer.control->OpenSession(request_id, reserved_tokens + 1);
  if (!session.ok()) {
    return session.status().WithContext("opening its session on " + peer.name);
  }
  {
    std::lock_guard lock(mutex_);
    ++open_[static_cast<size_t>(rank)];
  }
  return std::unique_ptr<ResidencyRequest>(std::make_unique<GpuCacheRequest>(*session, rank));
}

Status DeviceCacheRankResidency::Close(ResidencyRequest& request) {
  const auto& held = static_cast<GpuCacheRequest&>(request);
  const size_t rank = static_cast<size_t>(held.cache());
  // Its rank is replaced only once none of its sessions is open: still the one that opened it.
  const Status closed = ranks_[rank].control->CloseSession(held.session());
  {
    std::lock_guard lock(mutex_);
    --open_[rank];
  }
  wake_.notify_all();  // the last one of a lost rank: the watcher may reconnect it
  return closed.WithContext("closing a session on " + ranks_[rank].name);
}

Status DeviceCacheRankResidency::RankLostLocked(size_t rank) const {
  // A new connection waits for the next admission: the rank is back unless that one is lost.
  if (ready_[rank].has_value()) return ready_[rank]->control->Health();
  const Status lost = ranks_[rank].control->Health();
  return lost.ok() ? failed_[rank] : lost;
}

Status DeviceCacheRankResidency::RankLost(int rank) const {
  Status lost;
  {
    std::lock_guard lock(mutex_);
    lost = RankLostLocked(static_cast<size_t>(rank));
  }
  if (lost.ok() || ranks_.size() == 1) return lost;
  return Status(lost.code(), "cache rank " + std::to_string(rank) + " of " +
                                 std::to_string(ranks_.size()) + ": " + lost.message());
}

void DeviceCacheRankResidency::MarkFailed(int rank, const Status& why) {
  std::lock_guard lock(mutex_);
  Status& failed = failed_[static_cast<size_t>(rank)];
  if (failed.ok()) failed = why.WithContext(ranks_[static_cast<size_t>(rank)].name);
}

Status DeviceCacheRankResidency::Broken() const {
  if (ranks_.size() == 1) return RankLost(0);
  std::string why;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const Status lost = RankLost(static_cast<int>(r));
    if (lost.ok()) return Status::Ok();
    why += (why.empty() ? "" : "; ") + lost.message();
  }
  return UnavailableError("every cache rank is lost: " + why);
}

Status DeviceCacheRankResidency::RequestBroken(const ResidencyRequest& request) const {
  return RankLost(static_cast<const GpuCacheRequest&>(request).cache());
}

uint64_t DeviceCacheRankResidency::TotalBytesOut() const {
  uint64_t total = retired_out_;
  for (const DeviceCacheRankPeer& rank : ranks_) total += rank.client->total_bytes_out();
  return total;
}

uint64_t DeviceCacheRankResidency::TotalBytesBack() const {
  uint64_t total = retired_back_;
  for (const DeviceCacheRankPeer& rank : ranks_) total += rank.client->total_bytes_back();
  return total;
}

int64_t DeviceCacheRankResidency::GraphKeySlot(size_t rank, int64_t rows,
                                               int64_t decode_rows) const {
  // rows <= 2^24 (25 bits from bit 24), decode rows <= 2^20 (DevicePlaneLimits::Check); the
  // generation's low 14 bits above them (a graph of 16384 connections ago is long evicted).
  return (static_cast<int64_t>(generation_[rank] & 0x3fff) << 49) | (rows << 24) | decode_rows;
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
  RUBATO_ASSIGN_OR_RETURN(Gauge * link_up,
                          registry.AddGauge("rubato:cache_link_up",
                                            "1 while a cache rank answers heartbeats and its data "
                                            "plane works, else 0."));
  registry.AddCollector([this, link_up] { link_up->Set(Broken().ok() ? 1.0 : 0.0); });
  return Status::Ok();
}

void DeviceCacheRankResidency::CountSteps() {
  if (bytes_out_metric_ == nullptr) return;
  const uint64_t out = TotalBytesOut();
  const uint64_t back = TotalBytesBack();
  bytes_out_metric_->Increment(static_cast<double>(out - counted_out_));
  bytes_back_metric_->Increment(static_cast<double>(back - counted_back_));
  counted_out_ = out;
  counted_back_ = back;
}

std::string DeviceCacheRankResidency::StatsLine() const {
  char text[160];
  std::snprintf(text, sizeof(text), " cache_bytes_out=%llu cache_bytes_back=%llu",
                static_cast<unsigned long long>(TotalBytesOut()),
                static_cast<unsigned long long>(TotalBytesBack()));
  return text;
}

}  // namespace rubato
