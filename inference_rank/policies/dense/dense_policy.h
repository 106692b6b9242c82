// Dense attention (docs/design.md §4.1): every query attends every earlier position. No backend
// half, no per-request state; on offloaded KV the cache rank attends (its `attention` selector) and
// returns each decode token's attention output.
#pragma once

#include <memory>

#include "common/config.h"
#include "inference_rank/attention/policy.h"

namespace rubato {

class DensePolicy final : public AttentionPolicy {
 public:
  std::string_view name() const override { return "dense"; }
  const PolicyTraits& traits() const override;
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model, int max_batch) const override;
  Result<CacheSelectorSpec> MakeCacheSelector() const override {
    return CacheSelectorSpec{"attention"};
  }
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override;
};

// `policy: {name: dense}`: no parameters (any key is an error naming it).
Result<std::unique_ptr<AttentionPolicy>> CreateDensePolicy(const PolicySection& section);

}  // namespace rubato
