// The offloaded residency's engine half and its cache-rank connection (see
// offloaded_residency.h).
#include "inference_rank/residency/offloaded/offloaded_residency.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "common/logging.h"
#include "inference_rank/residency/offloaded/offloaded_cpu_backend.h"
#include "inference_rank/residency/offloaded/remote_cache.h"

#ifdef RUBATO_HAS_CUDA
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"
#include "inference_rank/residency/offloaded/offloaded_cuda_backend.h"
#endif
#if defined(RUBATO_HAS_CUDA) && defined(RUBATO_HAS_NCCL)
#include "inference_rank/residency/offloaded/remote_device_cache.h"
#endif

namespace rubato {
namespace {

// One request's session, attached to its forward entries.
class OffloadedRequest final : public ResidencyRequest {
 public:
  OffloadedRequest(KvOffloadExchange* exchange, uint64_t session_id)
      : forward_(exchange, session_id) {}
  void AttachTo(ForwardEntry& entry) const override { entry.residency = &forward_; }
  uint64_t session_id() const { return forward_.session_id; }

 private:
  OffloadForward forward_;
};

}  // namespace

Result<OffloadTarget> ConnectOffload(const RubatoConfig& config, const CacheSelectorSpec& selection,
                                     const ModelConfig& model) {
  CacheClientOptions options;
  options.pack_layers = config.topology.pack_layers;
  options.delta_replies = config.topology.delta_replies;
  options.selection = selection;
  // The wire and the cache rank's store in the model's K/V dtype: the CUDA model's engine.dtype,
  // the CPU model's f32.
  options.kv_dtype =
      config.engine.backend == EngineSection::Backend::kCuda ? config.engine.dtype : DType::kF32;
  // A reply may wait for a whole pack of another request's prefill: the control plane's
  // deadline, not the heartbeat, bounds it; a lost cache rank ends it sooner.
  options.timeout = std::chrono::milliseconds(
      std::max(config.limits.rpc_timeout_ms, 5 * config.limits.heartbeat_ms));
  OffloadTarget target;
  target.selection = selection;
  if (config.topology.mode == TopologySection::Mode::kDisaggregated) {
    const LimitsSection limits = config.limits;
    const RemoteDataPlane plane{config.topology.transport, config.engine.device};
    // A lost cache rank is reconnected at once, then after the heartbeat period, doubling up
    // to 10 s.
    const ReconnectBackoff backoff = ReconnectBackoffFromLimits(limits);
    // One cache rank must answer at start; with several, those not up yet (pods that start
    // together) are connected in the background and take requests once they answer.
    const std::vector<std::string>& endpoints = config.topology.cache_endpoints;
    std::vector<MultiCacheRank::Rank> ranks;
    std::string failures;
    for (const std::string& endpoint : endpoints) {
      ReconnectingCacheRank::Connector connect = [endpoint, model, options, limits,
                                                  plane](const std::atomic<bool>* abandon) {
        return RemoteCacheRank::Connect(endpoint, model, options, limits, plane, abandon);
      };
      Result<std::unique_ptr<ReconnectingCacheRank>> link =
          ReconnectingCacheRank::Connect(connect, backoff);
      if (!link.ok() && endpoints.size() == 1) return link.status();
      if (!link.ok()) {
        failures += (failures.empty() ? "" : "; ") + link.status().message();
        RUBATO_LOG_WARN("offload",
                        "cache rank {} not up at start ({}); connecting in the "
                        "background",
                        endpoint, link.status().message());
        link = ReconnectingCacheRank::StartDisconnected(std::move(connect), backoff, link.status());
      }
      ranks.push_back(MultiCacheRank::Rank{endpoint, std::move(link).value()});
    }
    if (ranks.size() > 1 && std::all_of(ranks.begin(), ranks.end(), [](const auto& rank) {
          return rank.link->current() == nullptr;
        })) {
      return UnavailableError("none of the " + std::to_string(ranks.size()) +
                              " cache ranks answered: " + failures);
    }
    target.remote = std::make_unique<MultiCacheRank>(std::move(ranks), model);
    target.client = target.remote.get();
  } else {
    // The colocated cache rank's storage from the config's cache section (on the engine's GPU
    // unless cache.device names another).
    const int device = config.cache.device >= 0 ? config.cache.device : config.engine.device;
    RUBATO_ASSIGN_OR_RETURN(const CacheServiceOptions service,
                            CacheServiceOptionsFromConfig(config.cache, device));
    RUBATO_ASSIGN_OR_RETURN(target.colocated, ColocatedCacheRank::Create(model, options, service));
    target.client = &target.colocated->client();
  }
  return target;
}

OffloadedResidency::OffloadedResidency(KvOffloadClient& client, CacheRankClient* data_client)
    : client_(&client), data_client_(data_client) {}

OffloadedResidency::OffloadedResidency(OffloadTarget target)
    : target_(std::move(target)), client_(target_.client) {}

CacheRankClient* OffloadedResidency::data_client() const {
  return data_client_ != nullptr ? data_client_ : target_.data_client();
}

Result<int> LocalWindowFor(const CacheSelectorSpec& spec) {
  const CacheSelector* selector = FindCacheSelector(spec.name);
  if (selector == nullptr) {
    return InvalidArgumentError("offloaded KV: unknown cache selector '" + spec.name + "'");
  }
  if (selector->traits().partial_attention) return 0;
  if (spec.dense_steps > 0) return -1;
  // The recent segment of a decode token at a position past every sink and window: the range
  // of its own entry, or of the entry before it for a selector that serves the next step.
  constexpr int kPosition = 1 << 24;
  const int entry = selector->traits().serves_same_step ? kPosition : kPosition - 1;
  const int recent_begin = selector->ReplyRangeFor(spec, entry, 1).recent_begin;
  return std::max(0, kPosition - recent_begin);
}

Status OffloadedResidency::Attach(Model& model, const AttentionPolicy* policy, int /*max_batch*/) {
  std::unique_ptr<ResidencyBackend> half;
  if (model.backend_name() == "cpu") {
    half = MakeOffloadedCpuBackend(model.config());
    // The CPU model checks every local read against the released blocks (CheckLocalReads); the
    // CUDA model's halves keep every position, as before. The sessions' selection decides what
    // is read locally: the target's, the data client's, else the policy's (null: dense).
    CacheSelectorSpec selection;
    if (target_.client != nullptr) {
      selection = target_.selection;
    } else if (data_client_ != nullptr) {
      selection = data_client_->selection();
    } else if (policy != nullptr) {
      RUBATO_ASSIGN_OR_RETURN(selection, policy->MakeCacheSelector());
    }
    RUBATO_ASSIGN_OR_RETURN(local_window_, LocalWindowFor(selection));
  }
#ifdef RUBATO_HAS_CUDA
  if (model.backend_name() == "cuda") half = MakeOffloadedCudaBackend(model.config());
#endif
  if (half == nullptr) {
    return UnsupportedError("offloaded KV: no model half for the " +
                            std::string(model.backend_name()) + " model in this build");
  }
  return model.SetResidencyBackend(std::move(half));
}

Result<std::unique_ptr<ResidencyRequest>> OffloadedResidency::Open(uint64_t request_id,
                                                                   int reserved_tokens) {
  // Positions 0..reserved_tokens are handed over: the last sampled token is never fed back.
  Result<uint64_t> session = client_->OpenSession(request_id, reserved_tokens + 1);
  if (!session.ok()) return session.status().WithContext("opening its cache-rank session");
  return std::unique_ptr<ResidencyRequest>(std::make_unique<OffloadedRequest>(client_, *session));
}

Status OffloadedResidency::Close(ResidencyRequest& request) {
  // Closed even on a broken client, which then only forgets it (a reconnecting client waits
  // for its sessions to end); the error is news only while the client works.
  const uint64_t session = static_cast<OffloadedRequest&>(request).session_id();
  const Status closed = client_->CloseSession(session);
  if (!closed.ok() && client_->Broken().ok()) {
    RUBATO_LOG_WARN("engine", "closing cache-rank session {}: {}", session, closed.message());
  }
  return Status::Ok();
}

Status OffloadedResidency::RequestBroken(const ResidencyRequest& request) const {
  return client_->SessionBroken(static_cast<const OffloadedRequest&>(request).session_id());
}

Status OffloadedResidency::RegisterMetrics(MetricsRegistry& registry) {
  if (target_.remote != nullptr) return target_.remote->RegisterMetrics(registry);
  CacheRankClient* client = data_client();
  return client != nullptr ? client->RegisterMetrics(registry) : Status::Ok();
}

// " offload_bytes_sent=... offload_bytes_received=... pack_wait_ms=..." (the run's totals, over
// every cache rank), then per step (a forward that offloaded K/V) the bytes each way and the
// exposed wait (time blocked on replies), and the cache ranks' selection time (their replies,
// attention on the cache rank included) and peak KV memory (of their storage: host, pinned or
// device; summed over the ranks). A selector that replies rows adds whether replies are deltas,
// the compact rows received and those full replies would have carried, and the bytes per step
// of full replies (step_bytes_received is what came), summed over the ranks.
std::string OffloadedResidency::StatsLine() const {
  std::vector<const CacheRankClient*> clients;
  if (target_.remote != nullptr) {
    for (int r = 0; r < target_.remote->num_ranks(); ++r) {
      if (RemoteCacheRank* rank = target_.remote->rank(r).current()) {
        clients.push_back(&rank->client());
      }
    }
  } else if (data_client() != nullptr) {
    clients.push_back(data_client());
  }
  if (clients.empty()) return "";
  uint64_t sent = 0, received = 0, steps = 0;
  double wait_seconds = 0.0;
  for (const CacheRankClient* client : clients) {
    sent += client->bytes_sent();
    received += client->bytes_received();
    wait_seconds += client->pack_wait_seconds();
    steps = std::max(steps, client->steps());  // the ranks serve the same steps
  }
  const double per_step = static_cast<double>(std::max<uint64_t>(steps, 1));
  std::string text = fmt::format(
      " offload_bytes_sent={} offload_bytes_received={} pack_wait_ms={:.1f} offload_steps={} "
      "step_bytes_sent={:.0f} step_bytes_received={:.0f} step_wait_ms={:.3f}",
      sent, received, wait_seconds * 1e3, steps, static_cast<double>(sent) / per_step,
      static_cast<double>(received) / per_step, wait_seconds * 1e3 / per_step);
  uint64_t rows_received = 0, rows_full = 0, full_reply_bytes = 0;
  bool delta_replies = false;
  for (const CacheRankClient* client : clients) {
    rows_received += client->compact_rows_received();
    rows_full += client->compact_rows_full();
    full_reply_bytes += client->full_reply_bytes();
    delta_replies = delta_replies || client->delta_replies();
  }
  if (rows_full > 0) {  // a selector that replies rows
    text += fmt::format(
        " delta_replies={} compact_rows_received={} compact_rows_full={} "
        "step_full_reply_bytes={:.0f}",
        delta_replies ? 1 : 0, rows_received, rows_full,
        static_cast<double>(full_reply_bytes) / per_step);
  }
  PredictionCounters predictions;  // a predicting selector's (asyncspade), from the cache ranks
  if (target_.colocated != nullptr) {
    const CacheServiceStats stats = target_.colocated->service().Stats();
    predictions = stats.predictions;
    text +=
        fmt::format(" cache_selection_ms={:.1f} cache_memory_peak_bytes={} cache_memory={}",
                    stats.selection_seconds * 1e3, stats.store.bytes_reserved_peak, stats.memory);
  } else if (target_.remote != nullptr) {
    // The cache ranks' own counters (Stats RPC); a cache rank that does not answer leaves them
    // out of the line rather than failing a finished run.
    double selection_seconds = 0.0, peak_bytes = 0.0;
    bool answered = true;
    for (int r = 0; r < target_.remote->num_ranks() && answered; ++r) {
      const Result<rpc::StatsResponse> stats = target_.remote->rank(r).Stats();
      answered = stats.ok();
      if (!answered) break;
      const auto counter = [&](const std::string& name) {
        const auto found = stats->counters().find(name);
        return found == stats->counters().end() ? 0.0 : found->second;
      };
      selection_seconds += counter("selection_seconds");
      peak_bytes += counter("bytes_reserved_peak");
      predictions.cosine_sum += counter("prediction_cosine_sum");
      predictions.cosine_count += static_cast<uint64_t>(counter("prediction_cosine_count"));
      predictions.overlap_hits += static_cast<uint64_t>(counter("prediction_overlap_hits"));
      predictions.overlap_total += static_cast<uint64_t>(counter("prediction_overlap_total"));
    }
    if (answered) {
      text += fmt::format(" cache_selection_ms={:.1f} cache_memory_peak_bytes={:.0f}",
                          selection_seconds * 1e3, peak_bytes);
    }
  }
  return text + PredictionCountersText(predictions);
}

Status CheckGpuCachePolicy(const AttentionPolicy* policy) {
  if (policy == nullptr) return Status::Ok();
  // What the policy asks of a cache rank, by its selector's traits: attention there, or the
  // exact top-k (selected and sent as deltas on the cache GPU).
  Result<CacheSelectorSpec> spec = policy->MakeCacheSelector();
  const CacheSelector* selector = spec.ok() ? FindCacheSelector(spec->name) : nullptr;
  if (selector != nullptr && selector->traits().partial_attention) return Status::Ok();
  if (spec.ok() && spec->name == "oracle_topk" && spec->dense_steps == 0) return Status::Ok();
  // AsyncSpade: the same selection one step ahead from predicted queries (its warm-up steps
  // select with the real query; docs/asyncspade.md "On a GPU cache rank").
  if (spec.ok() && spec->name == "asyncspade") return Status::Ok();
  return UnsupportedError(
      "cache.memory: device (a GPU cache rank in this process) runs attention, the exact "
      "top-k (oracle_topk) or asyncspade on the cache GPU; policy '" +
      std::string(policy->name()) +
      "' selects rows there otherwise, which needs cache.memory pageable or pinned");
}

Result<std::shared_ptr<Residency>> CreateOffloadedResidency(const ResidencySetup& setup) {
  if (setup.model == nullptr) {
    return InvalidArgumentError("offloaded KV: no model shapes for its cache-rank sessions");
  }
  CacheSelectorSpec selection;  // dense without a policy
  if (setup.policy != nullptr) {
    RUBATO_ASSIGN_OR_RETURN(selection, setup.policy->MakeCacheSelector());
  }
  const RubatoConfig config = setup.config != nullptr ? *setup.config : DefaultConfig();
  if (config.cache.memory == CacheSection::Memory::kDevice &&
      config.topology.mode == TopologySection::Mode::kColocated) {
    // The cache rank on a GPU of this process: its store, its attention or selection, no host
    // in the step.
    RUBATO_RETURN_IF_ERROR(CheckGpuCachePolicy(setup.policy));
    if (selection.name != "attention" && config.engine.backend != EngineSection::Backend::kCuda) {
      return UnsupportedError(
          "cache.memory: device (a GPU cache rank in this process) with policy '" +
          std::string(setup.policy->name()) + "' needs the CUDA model (engine.backend: cuda)");
    }
#ifdef RUBATO_HAS_CUDA
    const int max_context = config.engine.max_context > 0 ? config.engine.max_context
                                                          : setup.model->max_position_embeddings;
    auto residency = std::make_shared<GpuCacheResidency>(
        config.cache, max_context, config.engine.max_batch + config.engine.prefill_chunk,
        config.engine.block_size);
    residency->set_delta_replies(config.topology.delta_replies);
    return std::shared_ptr<Residency>(std::move(residency));
#else
    return UnsupportedError("cache.memory: device needs a CUDA build of rubato");
#endif
  }
#if defined(RUBATO_HAS_CUDA) && defined(RUBATO_HAS_NCCL)
  if (config.topology.mode == TopologySection::Mode::kDisaggregated &&
      config.topology.transport == TopologySection::Transport::kNccl &&
      config.engine.backend == EngineSection::Backend::kCuda && selection.name == "attention") {
    // A cache rank that keeps the KV on its GPU says so in its Hello: the device data plane,
    // attention there, requests placed over several by free budget; one in host memory is
    // connected again for layer packs.
    RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<Residency> device,
                            ConnectDeviceCacheRank(config, *setup.model));
    if (device != nullptr) return device;
  }
#endif
  RUBATO_ASSIGN_OR_RETURN(OffloadTarget target, ConnectOffload(config, selection, *setup.model));
  return std::shared_ptr<Residency>(std::make_shared<OffloadedResidency>(std::move(target)));
}

}  // namespace rubato
