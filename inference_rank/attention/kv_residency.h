// Where a request's full KV lives, chosen apart from the attention policy (which rows a step
// attends). A policy declares the residencies it supports (policy.h PolicyTraits); an
// unsupported pair is refused by name before any weights load. docs/attention_seam.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace rubato {

enum class KvResidency : uint8_t {
  kLocal,        // every position in the inference rank's paged KV cache
  kOffloaded,    // the full KV on a cache rank; compact rows come back in layer packs
  kEvicting,     // a fixed budget of slots per layer and KV head, one overwritten per step
  kSplitByHead,  // representative heads local, the others offloaded
};

inline constexpr KvResidency kAllResidencies[] = {KvResidency::kLocal, KvResidency::kOffloaded,
                                                  KvResidency::kEvicting,
                                                  KvResidency::kSplitByHead};

inline std::string_view KvResidencyName(KvResidency residency) {
  switch (residency) {
    case KvResidency::kLocal:
      return "local";
    case KvResidency::kOffloaded:
      return "offloaded";
    case KvResidency::kEvicting:
      return "evicting";
    case KvResidency::kSplitByHead:
      return "split_by_head";
  }
  return "?";
}

inline std::optional<KvResidency> ParseKvResidency(std::string_view name) {
  for (KvResidency residency : kAllResidencies) {
    if (KvResidencyName(residency) == name) return residency;
  }
  return std::nullopt;
}

// A set of residencies, one bit each.
struct ResidencySet {
  uint32_t bits = 0;
  constexpr ResidencySet() = default;
  constexpr ResidencySet(std::initializer_list<KvResidency> list) {
    for (KvResidency r : list) bits |= 1u << static_cast<unsigned>(r);
  }
  constexpr bool Has(KvResidency r) const { return (bits >> static_cast<unsigned>(r)) & 1u; }
};

}  // namespace rubato
