// The attention policies rubato knows, in one static table (policy_registry.cc), and the
// validation of the config's `policy` section and KV residency before any weights load:
// "rubato.yaml: policy.name: unknown policy 'sfi2' (known: dense, streaming_llm, sfi,
// oracle_topk)", "policy 'sfi' does not support offloaded KV (supported: local)". Adding a
// policy is one folder here plus one line of the table. docs/attention_seam.md.
//
// The old spellings stay: `offload_dense` is dense and `offload_topk` is oracle_topk (the same
// parameters), both on offloaded KV (engine.kv_residency: offloaded).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cache_rank/cache_selector.h"
#include "common/config.h"
#include "common/status.h"
#include "inference_rank/attention/kv_residency.h"
#include "inference_rank/attention/policy.h"

namespace rubato {

// A validated policy with its parameters, on a residency it supports.
struct PolicyChoice {
  std::string name;  // the registered name ("dense" for offload_dense)
  KvResidency residency = KvResidency::kLocal;
  std::shared_ptr<AttentionPolicy> policy;
  // Offloaded KV: what the cache rank selects for the policy (its cache-rank half).
  std::optional<CacheSelectorSpec> offload;
  // The residency table's name when it is not the kind's own ("placed": offloaded KV with this
  // rank's paged cache as one more tier); empty otherwise.
  std::string residency_name;
};

// The policy an old spelling names ("dense" for "offload_dense"); nullopt for any other name.
// Such a name means offloaded KV: any other residency given with it is a conflict.
std::optional<std::string_view> OffloadedAliasOf(std::string_view name);

// Names accepted by `policy.name` / `--policy`, in table order (old spellings not included).
std::vector<std::string> KnownPolicyNames();

// Checks the name and every parameter key of `section` and that the policy supports
// `residency` (none given: local where the policy supports it, else its first one); errors name the
// section's source file and key path ("rubato.yaml: policy.budget: unknown key", "rubato.yaml:
// policy.recent_window: must be in [1, ...], got 0").
Result<PolicyChoice> ResolvePolicy(const PolicySection& section,
                                   std::optional<KvResidency> residency = std::nullopt);

// engine.kv_residency ("auto" | "local" | "offloaded" | "evicting" | "split_by_head" |
// "placed"), then ResolvePolicy; "auto" is offloaded with a cache rank (topology.mode
// disaggregated), else the policy's default; "placed" is offloaded KV placed per request
// (residency_name "placed").
Result<PolicyChoice> ResolvePolicy(const RubatoConfig& config);

}  // namespace rubato
