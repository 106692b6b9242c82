// What the residency table (residency_registry.h) hands a residency's factory: the policy its
// requests follow, the model's shapes and the config its peers are found in.
#pragma once

#include "common/config.h"
#include "common/hf_config.h"
#include "inference_rank/attention/policy.h"

namespace rubato {

struct ResidencySetup {
  const AttentionPolicy* policy = nullptr;  // null: dense
  const ModelConfig* model = nullptr;       // the model its storage is shaped for (required)
  // topology, limits (e.g. where the offloaded residency's cache rank is); null: the defaults
  // (a cache rank in this process).
  const RubatoConfig* config = nullptr;
};

}  // namespace rubato
