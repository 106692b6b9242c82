// The colocated mode's cache rank (docs/design.md §1 "Colocated mode"): the cache service runs in
// this process, behind the same client the disaggregated mode uses, over the loopback transport.
// Sessions go to the service by direct calls instead of the RPC. This is how offloaded KV runs
// on one machine (and in CI): the same packs, replies and checks as between two processes.
//
//   RUBATO_ASSIGN_OR_RETURN(auto cache, ColocatedCacheRank::Create(model.config(), client, {}));
//   engine_options.residency = std::make_shared<OffloadedResidency>(cache->client(),
//   &cache->client());
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "cache_rank/cache_service.h"
#include "common/config.h"
#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/residency/offloaded/cache_client.h"
#include "transport/loopback_transport.h"

namespace rubato {

// The service options of a config's `cache:` section (budget, memory) for a cache rank on GPU
// `device` (pinned memory belongs to its context): what the colocated mode, `rubato cache` and
// the cache role under mpirun serve with. Memory this build cannot give is refused naming
// `memory_key` ("cache.memory", or the flag that set it).
Result<CacheServiceOptions> CacheServiceOptionsFromConfig(
    const CacheSection& cache, int device, std::string_view memory_key = "cache.memory");

class ColocatedCacheRank {
 public:
  static Result<std::unique_ptr<ColocatedCacheRank>> Create(
      const ModelConfig& model, const CacheClientOptions& client_options,
      const CacheServiceOptions& service_options);
  // The same over a given pair of transports of one world of two (rank 0 the service's, rank 1
  // the client's), e.g. NCCL between two GPUs of this process
  // (transport/nccl_host_staging.h: CreateNcclHostStagingPair).
  static Result<std::unique_ptr<ColocatedCacheRank>> CreateOver(
      const ModelConfig& model, const CacheClientOptions& client_options,
      const CacheServiceOptions& service_options,
      std::unique_ptr<transport::Transport> service_transport,
      std::unique_ptr<transport::Transport> client_transport);
  ~ColocatedCacheRank();

  CacheRankClient& client() { return *client_; }
  CacheService& service() { return *service_; }
  // The peer id the service knows the client by (for fault tests: service().ForgetPeer(...)).
  static constexpr uint64_t kPeerId = 1;

 private:
  class InProcessControl;
  ColocatedCacheRank() = default;

  std::unique_ptr<transport::LoopbackHub> hub_;
  std::unique_ptr<CacheService> service_;
  std::unique_ptr<InProcessControl> control_;
  std::unique_ptr<transport::Transport> client_transport_;
  std::unique_ptr<CacheRankClient> client_;
};

}  // namespace rubato
