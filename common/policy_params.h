// Policy parameters in the config: the rule their keys follow and the YAML they are written back
// as. ParseConfig keeps a policy's parameters as YAML for the policy to read (its own keys and
// ranges); these two functions are what the config itself guarantees about them.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>

#include "common/status.h"

namespace rubato {

// Every map key under `params`, at any depth, is a name: a scalar of 1 to 128 bytes without
// control characters. Otherwise "SOURCE: KEY_PATH.PLACE: keys must be names ..., got ... (line N)".
Status CheckPolicyParamKeys(const YAML::Node& params, const std::string& source,
                            const std::string& key_path);

// Writes the entries of the map `params` into the map `out` is inside, so that they read back
// equal: quoted scalars stay quoted, text that plain YAML would change is quoted, tags, styles,
// anchors and aliases are kept.
void WritePolicyParams(YAML::Emitter& out, const YAML::Node& params);

}  // namespace rubato
