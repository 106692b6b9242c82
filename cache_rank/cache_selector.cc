// The table of cache selectors (cache_selector.h) and the look-ups over it.
#include "cache_rank/cache_selector.h"

#include <fmt/format.h>

#include "cache_rank/selectors/asyncspade_selector.h"
#include "cache_rank/selectors/attention_selector.h"
#include "cache_rank/selectors/oracle_topk_selector.h"

namespace rubato {
namespace {

// Every cache selector, one line each (the shape of NCCL's ncclTransports[]).
constexpr const CacheSelector* kCacheSelectors[] = {
    &kAttentionCacheSelector,
    &kOracleTopKCacheSelector,
    &kAsyncSpadeCacheSelector,
};

}  // namespace

std::string PredictionCountersText(const PredictionCounters& counters) {
  std::string text;
  if (counters.cosine_count > 0) {
    text += fmt::format(" prediction_cosine={:.4f}",
                        counters.cosine_sum / static_cast<double>(counters.cosine_count));
  }
  if (counters.overlap_total > 0) {
    text += fmt::format(" prediction_overlap={:.4f}", static_cast<double>(counters.overlap_hits) /
                                                          static_cast<double>(counters.overlap_total));
  }
  return text;
}

const CacheSelector* FindCacheSelector(std::string_view name) {
  for (const CacheSelector* selector : kCacheSelectors) {
    if (selector->name() == name) return selector;
  }
  return nullptr;
}

std::vector<std::string> CacheSelectorNames() {
  std::vector<std::string> names;
  for (const CacheSelector* selector : kCacheSelectors) names.emplace_back(selector->name());
  return names;
}

Result<const CacheSelector*> ResolveCacheSelector(const CacheSelectorSpec& spec) {
  const CacheSelector* selector = FindCacheSelector(spec.name);
  if (selector == nullptr) {
    std::string known;
    for (const std::string& name : CacheSelectorNames()) {
      known += (known.empty() ? "" : ", ") + name;
    }
    return InvalidArgumentError("cache rank: unknown selector '" + spec.name +
                                "' (known: " + known + ")");
  }
  RUBATO_RETURN_IF_ERROR(selector->Validate(spec));
  return selector;
}

}  // namespace rubato
