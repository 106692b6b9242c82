// The local residency: the paged cache of this rank holds every position of a request (what
// the engine does without a residency). No storage of its own, no model half, no peer; its
// requests may be preempted and recomputed.
#pragma once

#include <memory>

#include "common/status.h"
#include "inference_rank/residency/residency.h"
#include "inference_rank/residency/residency_setup.h"

namespace rubato {

class LocalResidency final : public Residency {
 public:
  std::string_view name() const override { return "local"; }
  KvResidency kind() const override { return KvResidency::kLocal; }
  bool Preemptible() const override { return true; }  // the paged cache holds every position
};

// The residency table's factory (residency_registry.cc).
Result<std::shared_ptr<Residency>> CreateLocalResidency(const ResidencySetup& setup);

}  // namespace rubato
