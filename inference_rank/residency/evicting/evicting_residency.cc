// The evicting residency's engine half (see evicting_residency.h).
#include "inference_rank/residency/evicting/evicting_residency.h"

#include <string>

#include "common/logging.h"

namespace rubato {
namespace {

// One request's slot arrays, attached to its forward entries.
class EvictingRequest final : public ResidencyRequest {
 public:
  explicit EvictingRequest(SlotKvPool* pool) { forward_.pool = pool; }
  void AttachTo(ForwardEntry& entry) const override { entry.slots = &forward_; }
  SlotKvArrays& arrays() { return forward_.arrays; }

 private:
  SlotKvForward forward_;
};

}  // namespace

Status EvictingResidency::Check(const AttentionPolicy* policy) const {
  if (policy == nullptr) {
    return InvalidArgumentError(
        "evicting KV needs a policy that supports it (none given: dense attention)");
  }
  if (policy->traits().evicting_slots < 1) {
    return InvalidArgumentError("policy '" + std::string(policy->name()) +
                                "' supports evicting KV but declares no slots per request");
  }
  return Status::Ok();
}

Status EvictingResidency::Attach(Model& model, const AttentionPolicy* policy, int max_batch) {
  RUBATO_RETURN_IF_ERROR(Check(policy));
  const int slots = policy->traits().evicting_slots;
  // One slot array per request that may run: admission never waits on the pool.
  RUBATO_ASSIGN_OR_RETURN(pool_, model.CreateSlotKvPool(slots, max_batch));
  RUBATO_LOG_INFO("engine", "evicting KV: {} requests x {} slots per layer and KV head ({} MiB)",
                  max_batch, slots, pool_->pool_bytes() >> 20);
  return Status::Ok();
}

int EvictingResidency::ReservedTokens(int prompt_tokens, int /*longest*/) const {
  return prompt_tokens;  // the prompt alone: decode tokens write into the slots
}

Status EvictingResidency::ExplainTooLarge(int prompt_tokens, int blocks, int cache_blocks) const {
  return ResourceExhaustedError(
      "request: its prompt (" + std::to_string(prompt_tokens) + " tokens) prefills through " +
      std::to_string(blocks) + " KV blocks but the cache has " + std::to_string(cache_blocks) +
      " (engine.kv_pool_tokens, or engine.gpu_memory_utilization's share of free memory); its "
      "slot budget of " +
      std::to_string(pool_->shape().budget) +
      " tokens is reserved only for a prompt that fits; shorten the prompt or enlarge the pool");
}

Result<std::unique_ptr<ResidencyRequest>> EvictingResidency::Open(uint64_t /*request_id*/,
                                                                  int /*reserved_tokens*/) {
  auto request = std::make_unique<EvictingRequest>(pool_.get());
  // Cannot fail: one array per request that may run.
  RUBATO_RETURN_IF_ERROR(pool_->Reserve(request->arrays()).WithContext("reserving its slots"));
  return std::unique_ptr<ResidencyRequest>(std::move(request));
}

Status EvictingResidency::Close(ResidencyRequest& request) {
  return pool_->Release(static_cast<EvictingRequest&>(request).arrays());
}

Status EvictingResidency::PromptDone(ResidencyRequest& /*request*/, KvSequence& kv,
                                     PagedKvCache& cache) {
  // The prompt is in the slots now; its paged blocks go back. The positions stay counted: the
  // next decode token continues at num_tokens.
  const int positions = kv.num_tokens;
  RUBATO_RETURN_IF_ERROR(cache.Release(kv));
  kv.num_tokens = positions;
  return Status::Ok();
}

Status EvictingResidency::CheckRedo() const {
  return InternalError("a step on evicting KV cannot be redone (its slot was overwritten)");
}

Result<std::shared_ptr<Residency>> CreateEvictingResidency(const ResidencySetup& /*setup*/) {
  return std::shared_ptr<Residency>(std::make_shared<EvictingResidency>());
}

}  // namespace rubato
