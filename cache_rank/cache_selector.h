// Cache selectors (docs/design.md §3 "Policy", the optional cache-rank half of a policy): the rule
// that picks what the cache rank sends back for an offloaded request's decode step: stored rows
// (positions and their K / V), or the attention of the step's query over the stored KV (its
// output and log-sum-exp). Where the KV lives is the residency; which rows a step attends is
// the policy. An
// inference rank names a selector at OpenSession (CacheSelectorSpec); both ranks look it up in
// one static table (FindCacheSelector), so they size and read every reply alike.
//
// Selectors are stateless: one instance each, in selectors/ (one file pair per selector), listed
// once in cache_selector.cc's table. Every call gets the session's spec.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cache_rank/kv_store.h"
#include "common/status.h"
#include "transport/layer_pack.h"

namespace rubato {

// What an inference rank asks for at OpenSession: a selector by name ("attention" for the dense
// policy, "oracle_topk") and oracle_topk's parameters (attention ignores them).
struct CacheSelectorSpec {
  std::string name = "attention";
  int top_k = 2048;         // selected positions per KV head, >= 1
  int sink_tokens = 4;      // leading positions always kept, >= 0
  int recent_tokens = 256;  // trailing positions the inference rank reads in place, >= 1
};

// What the reply to one request entry carries: rows [0, sink_end) are the sink positions, then
// the selected ones; `slots` is the entry's reply_slots (rows per KV head, each filled); the
// inference rank's recent segment starts at `recent_begin`. `attention_queries` (0 or 1) is the
// entry's attention_queries: the reply also carries the attention of the entry's last query
// over every stored position (layer_pack.h).
struct ReplyRange {
  int sink_end = 0;
  int recent_begin = 0;
  int slots = 0;
  int attention_queries = 0;

  friend bool operator==(const ReplyRange&, const ReplyRange&) = default;
};

// What a selector asks of the inference rank, declared once (combinations follow from these,
// never from the selector's name).
struct CacheSelectorTraits {
  // KV packs carry the step's query: the selector scores the stored keys against it.
  bool needs_query = false;
  // The reply to a step's pack serves that step's own decode token, so a layer's attention waits
  // for it and packs hold one layer; otherwise a reply serves the request's next step.
  bool serves_same_step = false;
  // A decode token's reply is a partial attention result (output and log-sum-exp of its query
  // over the stored KV, the new token's included) instead of rows: the inference rank takes it
  // as the token's attention (CacheRankClient::PartialFor) and reads no K / V.
  bool partial_attention = false;
};

class CacheSelector {
 public:
  constexpr CacheSelector(std::string_view name, CacheSelectorTraits traits)
      : name_(name), traits_(traits) {}
  virtual ~CacheSelector() = default;
  CacheSelector(const CacheSelector&) = delete;  // one instance each, in the table
  CacheSelector& operator=(const CacheSelector&) = delete;

  std::string_view name() const { return name_; }
  const CacheSelectorTraits& traits() const { return traits_; }

  // Ok when `spec`'s parameters suit this selector; else an error naming the field.
  virtual Status Validate(const CacheSelectorSpec& spec) const = 0;
  // The reply range of a request entry of `new_tokens` positions from `first_position`; both
  // ranks compute it from the session's spec.
  virtual ReplyRange ReplyRangeFor(const CacheSelectorSpec& spec, int first_position,
                                   int new_tokens) const = 0;
  // Per KV head, the ReplyRangeFor(...).slots positions the reply carries for request entry
  // `request_index` of the pack's layer `layer_index`, ascending. `store` already holds the
  // pack's KV; `spec` passed Validate.
  virtual Result<KvHeadSelection> Select(const CacheSelectorSpec& spec, const KvStore& store,
                                         const LayerPackView& pack, uint32_t layer_index,
                                         uint32_t request_index) const = 0;

 private:
  std::string_view name_;
  CacheSelectorTraits traits_;
};

// The selector registered as `name`, or null.
const CacheSelector* FindCacheSelector(std::string_view name);
// Every registered name, in table order.
std::vector<std::string> CacheSelectorNames();
// FindCacheSelector, then Validate: "cache rank: unknown selector 'x' (known: attention,
// oracle_topk)", or the selector's complaint about a parameter.
Result<const CacheSelector*> ResolveCacheSelector(const CacheSelectorSpec& spec);

}  // namespace rubato
