// The residencies rubato knows, in one static table (residency_registry.cc), and the choice of
// one by name (engine.kv_residency / --kv-residency): "engine.kv_residency: unknown residency
// 'remote' (known: local, evicting, offloaded, split_by_head)", "engine.kv_residency:
// split_by_head is registered but not built yet (built: local, evicting, offloaded)", "policy
// 'sfi' does not support offloaded KV (supported: local)". Adding a residency is one folder here
// plus one line of the table. docs/residency.md.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "inference_rank/attention/kv_residency.h"
#include "inference_rank/residency/residency.h"
#include "inference_rank/residency/residency_setup.h"

namespace rubato {

// Names of the table, in table order, registered-but-absent ones included.
std::vector<std::string> KnownResidencyNames();
// The names of the table that are built.
std::vector<std::string> BuiltResidencyNames();

// What `name` names: InvalidArgument for a name not in the table, Unsupported for one that is
// registered but not built yet; both name it and the key.
Result<KvResidency> LookUpResidency(std::string_view name);

// The residency `name` for `setup` (LookUpResidency's refusals, then Unsupported when
// setup.policy does not support it, then the residency's own, e.g. a cache rank that cannot be
// reached).
Result<std::shared_ptr<Residency>> CreateResidency(std::string_view name,
                                                   const ResidencySetup& setup);

}  // namespace rubato
