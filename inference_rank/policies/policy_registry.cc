// The policy table and the residency checks (see policy_registry.h).
#include "inference_rank/policies/policy_registry.h"

#include <string_view>

#include "common/logging.h"
#include "inference_rank/attention/fidelity_guard.h"
#include "inference_rank/policies/asyncspade/asyncspade_policy.h"
#include "inference_rank/policies/dense/dense_policy.h"
#include "inference_rank/policies/kascade/kascade_policy.h"
#include "inference_rank/policies/longflow/longflow_policy.h"
#include "inference_rank/policies/oracle_topk/oracle_topk_policy.h"
#include "inference_rank/policies/sfi/sfi_policy.h"
#include "inference_rank/policies/streaming_llm/streaming_llm_policy.h"
#include "inference_rank/policies/synckv/synckv_policy.h"

namespace rubato {
namespace {

struct PolicyRegistration {
  std::string_view name;
  Result<std::unique_ptr<AttentionPolicy>> (*create)(const PolicySection& section);
  bool fidelity_guard;  // reads `policy.fidelity_guard` (inference_rank/attention/fidelity_guard.h)
};

// Every policy, one line each.
constexpr PolicyRegistration kPolicies[] = {
    {"dense", &CreateDensePolicy, false},
    {"streaming_llm", &CreateStreamingLlmPolicy, false},
    {"sfi", &CreateSfiPolicy, true},
    {"oracle_topk", &CreateOracleTopKPolicy, false},
    {"kascade", &CreateKascadePolicy, true},
    {"longflow", &CreateLongFlowPolicy, false},
    {"asyncspade", &CreateAsyncSpadePolicy, false},
    {"synckv", &CreateSyncKvPolicy, false},
};

// "policy.fidelity_guard: policy 'longflow' has no fidelity guard (supported by: sfi, kascade)"
// when the section sets it for a policy that does not read it.
Status CheckFidelityGuard(const PolicySection& section, const PolicyRegistration& entry) {
  if (entry.fidelity_guard || !section.params.IsMap() ||
      !section.params[kFidelityGuardKey].IsDefined()) {
    return Status::Ok();
  }
  std::string supported;
  for (const PolicyRegistration& other : kPolicies) {
    if (other.fidelity_guard)
      supported += (supported.empty() ? "" : ", ") + std::string(other.name);
  }
  return InvalidArgumentError(section.source + ": " + section.key_path + "." + kFidelityGuardKey +
                              ": policy '" + std::string(entry.name) +
                              "' has no fidelity guard (supported by: " + supported + ")");
}

// Old names: a policy on offloaded KV.
struct PolicyAlias {
  std::string_view name;
  std::string_view policy;
};
constexpr PolicyAlias kOffloadedAliases[] = {
    {"offload_dense", "dense"},
    {"offload_topk", "oracle_topk"},
};

// engine.kv_residency "auto": local where the policy supports it (the common case), else the
// first residency it supports (LongFlow: evicting).
KvResidency DefaultResidency(const AttentionPolicy& policy) {
  const ResidencySet supported = policy.traits().residencies;
  if (supported.Has(KvResidency::kLocal)) return KvResidency::kLocal;
  for (KvResidency residency : kAllResidencies) {
    if (supported.Has(residency)) return residency;
  }
  return KvResidency::kLocal;  // a policy with no residency: CheckResidency names the problem
}

}  // namespace

std::optional<std::string_view> OffloadedAliasOf(std::string_view name) {
  for (const PolicyAlias& alias : kOffloadedAliases) {
    if (name == alias.name) return alias.policy;
  }
  return std::nullopt;
}

std::vector<std::string> KnownPolicyNames() {
  std::vector<std::string> names;
  for (const PolicyRegistration& entry : kPolicies) names.emplace_back(entry.name);
  return names;
}

Result<PolicyChoice> ResolvePolicy(const PolicySection& section,
                                   std::optional<KvResidency> residency) {
  std::string_view name = section.name;
  for (const PolicyAlias& alias : kOffloadedAliases) {
    if (name != alias.name) continue;
    if (residency.has_value() && *residency != KvResidency::kOffloaded) {
      return InvalidArgumentError(
          section.source + ": " + section.key_path + ".name: policy '" + section.name +
          "' is policy '" + std::string(alias.policy) +
          "' on offloaded KV, which conflicts with engine.kv_residency (--kv-residency) " +
          std::string(KvResidencyName(*residency)) + "; use --policy " + std::string(alias.policy) +
          " with the residency you want");
    }
    RUBATO_LOG_INFO("policy", "policy '{}' is policy '{}' with engine.kv_residency: offloaded",
                    alias.name, alias.policy);
    name = alias.policy;
    residency = KvResidency::kOffloaded;
  }
  for (const PolicyRegistration& entry : kPolicies) {
    if (entry.name != name) continue;
    RUBATO_RETURN_IF_ERROR(CheckFidelityGuard(section, entry));
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<AttentionPolicy> policy, entry.create(section));
    if (!residency.has_value()) residency = DefaultResidency(*policy);
    RUBATO_RETURN_IF_ERROR(CheckResidency(*policy, *residency));
    PolicyChoice choice;
    choice.name = std::string(name);
    choice.residency = *residency;
    if (*residency == KvResidency::kOffloaded) {
      RUBATO_ASSIGN_OR_RETURN(choice.offload, policy->MakeCacheSelector());
    }
    choice.policy = std::move(policy);
    return choice;
  }
  std::string known;
  for (const std::string& known_name : KnownPolicyNames()) {
    known += (known.empty() ? "" : ", ") + known_name;
  }
  return InvalidArgumentError(section.source + ": " + section.key_path + ".name: unknown policy '" +
                              section.name + "' (known: " + known + ")");
}

Result<PolicyChoice> ResolvePolicy(const RubatoConfig& config) {
  if (config.engine.kv_residency == "auto") {
    // A cache rank to feed means offloaded KV; otherwise the policy's own default.
    if (config.topology.mode == TopologySection::Mode::kDisaggregated) {
      return ResolvePolicy(config.policy, KvResidency::kOffloaded);
    }
    return ResolvePolicy(config.policy, std::nullopt);
  }
  if (config.engine.kv_residency == "placed") {
    RUBATO_ASSIGN_OR_RETURN(PolicyChoice choice,
                            ResolvePolicy(config.policy, KvResidency::kOffloaded));
    choice.residency_name = "placed";
    return choice;
  }
  const std::optional<KvResidency> residency = ParseKvResidency(config.engine.kv_residency);
  if (!residency.has_value()) {
    return InvalidArgumentError("engine.kv_residency: '" + config.engine.kv_residency +
                                "' is not one of auto, local, offloaded, evicting, split_by_head, "
                                "placed");
  }
  return ResolvePolicy(config.policy, *residency);
}

}  // namespace rubato
