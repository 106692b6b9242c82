// The attention policies rubato knows, and validation of the config's `policy` section.
//
// Today only `dense` exists; the sparse policies of DESIGN §4 register here as they land.
// Validation happens once at start so that a typo ends the process with a clear message
// ("policy: unknown policy 'sfi2' (known: dense)") before any weights are loaded.
#pragma once

#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"

namespace rubato {

enum class PolicyKind { kDense };

// A validated policy choice with its parameters.
struct PolicyChoice {
  PolicyKind kind = PolicyKind::kDense;
  std::string name;
};

// Names accepted by `policy.name` / `--policy`.
std::vector<std::string> KnownPolicyNames();

// Checks the name and every parameter key of the `policy` section; errors name the section's
// source file and key path ("rubato.yaml: policy.budget: unknown key").
Result<PolicyChoice> ResolvePolicy(const PolicySection& section);

}  // namespace rubato
