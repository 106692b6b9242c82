// The residency table (see residency_registry.h).
#include "inference_rank/residency/residency_registry.h"

#include "inference_rank/residency/evicting/evicting_residency.h"
#include "inference_rank/residency/local/local_residency.h"
#include "inference_rank/residency/offloaded/offloaded_residency.h"
#include "inference_rank/residency/placed/placed_residency.h"
#include "inference_rank/residency/split_by_head/split_by_head_residency.h"

namespace rubato {
namespace {

struct ResidencyRegistration {
  std::string_view name;
  KvResidency kind;  // what policies declare support for (PolicyTraits::residencies)
  // Null: registered, not built yet.
  Result<std::shared_ptr<Residency>> (*create)(const ResidencySetup& setup);
};

// Every residency, one line each.
constexpr ResidencyRegistration kResidencies[] = {
    {"local", KvResidency::kLocal, &CreateLocalResidency},
    {"evicting", KvResidency::kEvicting, &CreateEvictingResidency},
    {"offloaded", KvResidency::kOffloaded, &CreateOffloadedResidency},
    {"split_by_head", KvResidency::kSplitByHead, &CreateSplitByHeadResidency},
    {"placed", KvResidency::kOffloaded, &CreatePlacedResidency},
};

std::string Joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

Result<const ResidencyRegistration*> Find(std::string_view name) {
  for (const ResidencyRegistration& entry : kResidencies) {
    if (entry.name != name) continue;
    if (entry.create == nullptr) {
      return UnsupportedError(
          "engine.kv_residency: " + std::string(name) +
          " is registered but not built yet (built: " + Joined(BuiltResidencyNames()) + ")");
    }
    return &entry;
  }
  return InvalidArgumentError("engine.kv_residency: unknown residency '" + std::string(name) +
                              "' (known: " + Joined(KnownResidencyNames()) + ")");
}

}  // namespace

std::vector<std::string> KnownResidencyNames() {
  std::vector<std::string> names;
  for (const ResidencyRegistration& entry : kResidencies) names.emplace_back(entry.name);
  return names;
}

std::vector<std::string> BuiltResidencyNames() {
  std::vector<std::string> names;
  for (const ResidencyRegistration& entry : kResidencies) {
    if (entry.create != nullptr) names.emplace_back(entry.name);
  }
  return names;
}

Result<KvResidency> LookUpResidency(std::string_view name) {
  RUBATO_ASSIGN_OR_RETURN(const ResidencyRegistration* entry, Find(name));
  return entry->kind;
}

Result<std::shared_ptr<Residency>> CreateResidency(std::string_view name,
                                                   const ResidencySetup& setup) {
  RUBATO_ASSIGN_OR_RETURN(const ResidencyRegistration* entry, Find(name));
  if (setup.policy != nullptr) RUBATO_RETURN_IF_ERROR(CheckResidency(*setup.policy, entry->kind));
  RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<Residency> residency, entry->create(setup));
  RUBATO_RETURN_IF_ERROR(residency->Check(setup.policy));
  return residency;
}

}  // namespace rubato
