// The evicting residency (docs/design.md §3 "KV residency"): every request holds a static slot
// array of the policy's traits().evicting_slots (B) per (layer, KV head), from a pool of max_batch
// arrays the model makes at Engine::Create (kv/slot_kv_pool.h, Model::CreateSlotKvPool). Its prompt
// prefills through the paged cache, which holds only the prompt and is released once the
// forward that ended the prompt moved it into the slots; decode tokens write into the slots
// (ForwardEntry::slots) and the policy's attention backend chooses which slot each overwrites.
// Admission and the paged cache's accounting use the prompt and B, never max_new_tokens. A step
// cannot be redone (its slot was overwritten). No model half: slot arrays are the model's
// generic storage. docs/longflow.md, docs/residency.md.
#pragma once

#include <memory>

#include "common/status.h"
#include "inference_rank/kv/slot_kv_pool.h"
#include "inference_rank/residency/residency.h"
#include "inference_rank/residency/residency_setup.h"

namespace rubato {

class EvictingResidency final : public Residency {
 public:
  std::string_view name() const override { return "evicting"; }
  KvResidency kind() const override { return KvResidency::kEvicting; }

  // InvalidArgument without a policy, or for one that declares no slots per request.
  Status Check(const AttentionPolicy* policy) const override;
  // The pool of max_batch slot arrays (admission never waits on it).
  Status Attach(Model& model, const AttentionPolicy* policy, int max_batch) override;
  int ReservedTokens(int prompt_tokens, int longest) const override;
  Status ExplainTooLarge(int prompt_tokens, int blocks, int cache_blocks) const override;
  Result<std::unique_ptr<ResidencyRequest>> Open(uint64_t request_id, int reserved_tokens) override;
  Status Close(ResidencyRequest& request) override;
  Status PromptDone(ResidencyRequest& request, KvSequence& kv, PagedKvCache& cache) override;
  Status CheckRedo() const override;

  // The pool Attach made (tests: arrays handed back), or null before.
  const SlotKvPool* pool() const { return pool_.get(); }

 private:
  std::unique_ptr<SlotKvPool> pool_;
};

// The residency table's factory (residency_registry.cc).
Result<std::shared_ptr<Residency>> CreateEvictingResidency(const ResidencySetup& setup);

}  // namespace rubato
