// Policy names and parameter validation (see policy_registry.h).
#include "inference_rank/policies/policy_registry.h"

#include "common/yaml_map_reader.h"

namespace rubato {

std::vector<std::string> KnownPolicyNames() { return {"dense"}; }

Result<PolicyChoice> ResolvePolicy(const PolicySection& section) {
  if (section.name == "dense") {
    // Dense attention has no parameters: any key is a mistake worth reporting.
    RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
    RUBATO_RETURN_IF_ERROR(params.Finish());
    return PolicyChoice{PolicyKind::kDense, section.name};
  }
  std::string known;
  for (const std::string& name : KnownPolicyNames()) known += (known.empty() ? "" : ", ") + name;
  return InvalidArgumentError(section.source + ": " + section.key_path + ".name: unknown policy '" +
                              section.name + "' (known: " + known + ")");
}

}  // namespace rubato
