// Where a new request's KV goes when several cache ranks serve one inference rank: the rank
// with the most free budget (its Stats RPC: bytes_capacity - bytes_in_use), ties to the lower
// index; a rank that is lost (or not yet reconnected) takes nothing. A pure function, so the
// rule is tested with made-up budgets (cache_placement_test.cc).
// Narrative: docs/disaggregated.md "Several cache ranks".
#pragma once

#include <cstdint>
#include <span>

namespace rubato {

// What placement knows of one cache rank when a request arrives.
struct CacheRankBudget {
  bool available = false;   // connected and not lost
  uint64_t bytes_free = 0;  // budget not reserved by open sessions
};

// The index of the available rank with the most free bytes (the lowest index among equals), or
// -1 when none is available.
int PickCacheRank(std::span<const CacheRankBudget> ranks);

}  // namespace rubato
