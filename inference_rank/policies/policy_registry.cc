// Policy names and parameter validation (see policy_registry.h).
#include "inference_rank/policies/policy_registry.h"

#include <limits>

#include "common/yaml_map_reader.h"

namespace rubato {
namespace {

// Dense attention has no parameters: any key is a mistake worth reporting.
Result<PolicyChoice> ResolveDense(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  RUBATO_RETURN_IF_ERROR(params.Finish());
  PolicyChoice choice;
  choice.kind = PolicyKind::kDense;
  choice.name = section.name;
  return choice;
}

// StreamingLLM: every query attends the first sink_tokens positions and the last
// recent_window positions up to itself (AttentionWindow).
Result<PolicyChoice> ResolveStreamingLlm(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  constexpr int64_t kMax = std::numeric_limits<int>::max();  // recent = kUnbounded is dense
  AttentionWindow window{kDefaultSinkTokens, kDefaultRecentWindow};
  RUBATO_RETURN_IF_ERROR(params.ReadInt("sink_tokens", 0, kMax, &window.sink_tokens));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("recent_window", 1, kMax, &window.recent_tokens));
  RUBATO_RETURN_IF_ERROR(params.Finish());
  PolicyChoice choice;
  choice.kind = PolicyKind::kStreamingLlm;
  choice.name = section.name;
  choice.window = window;
  return choice;
}

// SFI: parameters in sfi_policy.h; the window stays dense (see PolicyChoice::window).
Result<PolicyChoice> ResolveSfi(const PolicySection& section) {
  PolicyChoice choice;
  choice.kind = PolicyKind::kSfi;
  choice.name = section.name;
  RUBATO_ASSIGN_OR_RETURN(choice.sfi, ParseSfiPolicyConfig(section));
  return choice;
}

// The offloaded policies: the window stays dense (the cache rank chooses the keys).
Result<PolicyChoice> ResolveOffload(const PolicySection& section, PolicyKind kind) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  CacheSelectorSpec offload;  // "dense"
  if (kind == PolicyKind::kOffloadTopK) {
    offload.name = "oracle_topk";
    constexpr int64_t kMax = std::numeric_limits<int>::max();
    RUBATO_RETURN_IF_ERROR(params.ReadInt("top_k", 1, kMax, &offload.top_k));
    RUBATO_RETURN_IF_ERROR(params.ReadInt("sink_tokens", 0, kMax, &offload.sink_tokens));
    RUBATO_RETURN_IF_ERROR(params.ReadInt("recent_window", 1, kMax, &offload.recent_tokens));
  }
  RUBATO_RETURN_IF_ERROR(params.Finish());
  PolicyChoice choice;
  choice.kind = kind;
  choice.name = section.name;
  choice.offload = offload;
  return choice;
}

}  // namespace

std::vector<std::string> KnownPolicyNames() {
  return {"dense", "streaming_llm", "sfi", "offload_dense", "offload_topk"};
}

Result<PolicyChoice> ResolvePolicy(const PolicySection& section) {
  if (section.name == "dense") return ResolveDense(section);
  if (section.name == "streaming_llm") return ResolveStreamingLlm(section);
  if (section.name == "sfi") return ResolveSfi(section);
  if (section.name == "offload_dense") return ResolveOffload(section, PolicyKind::kOffloadDense);
  if (section.name == "offload_topk") return ResolveOffload(section, PolicyKind::kOffloadTopK);
  std::string known;
  for (const std::string& name : KnownPolicyNames()) known += (known.empty() ? "" : ", ") + name;
  return InvalidArgumentError(section.source + ": " + section.key_path + ".name: unknown policy '" +
                              section.name + "' (known: " + known + ")");
}

}  // namespace rubato
