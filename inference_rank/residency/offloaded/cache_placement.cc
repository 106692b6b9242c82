// PickCacheRank (cache_placement.h): the most free budget, ties to the lower index.
#include "inference_rank/residency/offloaded/cache_placement.h"

namespace rubato {

int PickCacheRank(std::span<const CacheRankBudget> ranks) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(ranks.size()); ++i) {
    const CacheRankBudget& rank = ranks[static_cast<size_t>(i)];
    if (!rank.available) continue;
    // Strictly more: an equal budget keeps the lower index.
    if (best < 0 || rank.bytes_free > ranks[static_cast<size_t>(best)].bytes_free) best = i;
  }
  return best;
}

}  // namespace rubato
