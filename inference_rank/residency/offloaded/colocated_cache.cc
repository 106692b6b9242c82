// ColocatedCacheRank (colocated_cache.h): a CacheService and a CacheRankClient joined by a
// two-rank loopback hub (rank 0 the cache, rank 1 the engine).
#include "inference_rank/residency/offloaded/colocated_cache.h"

#include <string>
#include <utility>

#ifdef RUBATO_HAS_CUDA_PINNED
#include "cache_rank/pinned_kv_storage.h"
#endif

namespace rubato {

Result<CacheServiceOptions> CacheServiceOptionsFromConfig(const CacheSection& cache, int device,
                                                          std::string_view memory_key) {
  CacheServiceOptions options;
  options.budget_bytes = cache.budget_bytes();
  const std::string memory = std::string(memory_key) + " '" +
                             std::string(ConfigEnumName(cache.memory)) + "'";
  switch (cache.memory) {
    case CacheSection::Memory::kPageable:
      break;
    case CacheSection::Memory::kPinned:
#ifdef RUBATO_HAS_CUDA_PINNED
      options.allocator = MakePinnedKvStorageAllocator(device);
      break;
#else
      (void)device;
      return UnsupportedError(memory + ": this rubato was built without CUDA");
#endif
    case CacheSection::Memory::kDevice:
      return UnsupportedError(memory +
                              ": a cache rank of its own process keeps KV in host memory "
                              "(pageable or pinned); a GPU cache rank runs in the inference "
                              "rank's process (topology.mode: colocated, engine.backend: cuda)");
  }
  return options;
}

// Sessions by direct calls into the service; health is the service's view of this peer.
class ColocatedCacheRank::InProcessControl final : public CacheSessionControl {
 public:
  explicit InProcessControl(CacheService& service) : service_(service) {}

  Result<uint64_t> OpenSession(uint64_t request_id, const SessionShape& shape,
                               const CacheSelectorSpec& selection) override {
    return service_.OpenSession(kPeerId, request_id, shape, selection);
  }
  Status CloseSession(uint64_t session_id) override {
    return service_.CloseSession(kPeerId, session_id);
  }
  Status Health() override { return service_.PeerHealth(kPeerId); }

 private:
  CacheService& service_;
};

Result<std::unique_ptr<ColocatedCacheRank>> ColocatedCacheRank::Create(
    const ModelConfig& model, const CacheClientOptions& client_options,
    const CacheServiceOptions& service_options) {
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<transport::LoopbackHub> hub,
                          transport::LoopbackHub::Create(2));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<transport::Transport> service_side, hub->Endpoint(0));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<transport::Transport> client_side, hub->Endpoint(1));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<ColocatedCacheRank> cache,
                          CreateOver(model, client_options, service_options,
                                     std::move(service_side), std::move(client_side)));
  cache->hub_ = std::move(hub);
  return cache;
}

Result<std::unique_ptr<ColocatedCacheRank>> ColocatedCacheRank::CreateOver(
    const ModelConfig& model, const CacheClientOptions& client_options,
    const CacheServiceOptions& service_options,
    std::unique_ptr<transport::Transport> service_transport,
    std::unique_ptr<transport::Transport> client_transport) {
  if (service_transport == nullptr || client_transport == nullptr ||
      service_transport->Rank() != 0 || client_transport->Rank() != 1) {
    return InvalidArgumentError(
        "colocated cache: needs the transports of ranks 0 (service) and 1 (client)");
  }
  std::unique_ptr<ColocatedCacheRank> cache(new ColocatedCacheRank());
  cache->client_transport_ = std::move(client_transport);
  cache->service_ = std::make_unique<CacheService>(service_options);
  RUBATO_RETURN_IF_ERROR(cache->service_->AddPeer(kPeerId, std::move(service_transport), 1));
  cache->control_ = std::make_unique<InProcessControl>(*cache->service_);
  CacheClientOptions options = client_options;
  if (options.cache_name == CacheClientOptions().cache_name) options.cache_name = "colocated cache";
  cache->client_ = std::make_unique<CacheRankClient>(options, model, *cache->client_transport_,
                                                     /*cache_peer=*/0, *cache->control_);
  RUBATO_RETURN_IF_ERROR(cache->client_->Broken());  // a selection the table refuses
  cache->service_->Start();
  return cache;
}

ColocatedCacheRank::~ColocatedCacheRank() {
  client_.reset();            // cancels what it still has posted
  if (service_ != nullptr) service_->Stop();
}

}  // namespace rubato
