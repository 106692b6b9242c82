// Cache selectors (docs/design.md §3 "Policy", the optional cache-rank half of a policy): the rule
// that picks what the cache rank sends back for an offloaded request's decode step: stored rows
// (positions and their K / V), or the attention of the step's query over the stored KV (its
// output and log-sum-exp). Where the KV lives is the residency; which rows a step attends is
// the policy. An
// inference rank names a selector at OpenSession (CacheSelectorSpec); both ranks look it up in
// one static table (FindCacheSelector), so they size and read every reply alike.
//
// One instance per selector, in selectors/ (one file pair per selector), listed once in
// cache_selector.cc's table. Every call gets the session's spec; a selector that keeps state per
// session (asyncspade's query windows) makes it with NewState, and the service hands it back to
// every Select of that session.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cache_rank/kv_store.h"
#include "common/status.h"
#include "transport/layer_pack.h"

namespace rubato {

// What an inference rank asks for at OpenSession: a selector by name ("attention" for the dense
// policy, "oracle_topk", "asyncspade") and its parameters (attention ignores them; the last four
// are asyncspade's, the client reads dense_steps).
struct CacheSelectorSpec {
  std::string name = "attention";
  int top_k = 2048;         // selected positions per KV head, >= 1
  int sink_tokens = 4;      // leading positions always kept, >= 0
  int recent_tokens = 256;  // trailing positions the inference rank reads in place, >= 1
  int query_window = 16;       // W: queries of the past the next one is regressed from, >= 1
  double ridge_lambda = 1e-2;  // the ridge term, relative to the window's mean squared norm, > 0
  // Decode steps after a prompt that attend densely on the inference rank (its paged cache holds
  // every position) while the query windows fill (the paper's theta); the cache rank selects
  // for them all the same, so the compact pools are warm when they are first read.
  int dense_steps = 0;
  // Layers per layer pack for a selector that serves the next step (0: the client's option,
  // topology.pack_layers); read by the client only.
  int pack_layers = 0;
  // Every how many steps of a session the predicted selection is compared with the exact top-k
  // of the query that came (a second scoring pass); 0: never.
  int overlap_every = 0;
};

// How well a predicting selector guessed, summed over steps: the cosine of each query head's
// predicted query against the real one, and how many of the real query's exact top-k positions
// the predicted selection held.
struct PredictionCounters {
  double cosine_sum = 0;
  uint64_t cosine_count = 0;   // (step, layer, query head) triples
  uint64_t overlap_hits = 0;   // positions of the exact top-k also selected
  uint64_t overlap_total = 0;  // positions of the exact top-k compared
  void Add(const PredictionCounters& other) {
    cosine_sum += other.cosine_sum;
    cosine_count += other.cosine_count;
    overlap_hits += other.overlap_hits;
    overlap_total += other.overlap_total;
  }
};

// The stats line's fields for them (`rubato generate`, either cache rank): " prediction_cosine=
// the mean cosine of predicted and real queries" and " prediction_overlap=the share of the real
// query's exact top-k the predicted selection held", each only once counted; "" before.
std::string PredictionCountersText(const PredictionCounters& counters);

// A selector's state for one session (NewState), owned by the cache service's session.
class CacheSelectorState {
 public:
  virtual ~CacheSelectorState() = default;
  PredictionCounters counters;
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
  // The state of a new session of `shape` (null: the selector keeps none).
  virtual std::unique_ptr<CacheSelectorState> NewState(const CacheSelectorSpec& /*spec*/,
                                                       const SessionShape& /*shape*/) const {
    return nullptr;
  }
  // Per KV head, the ReplyRangeFor(...).slots positions the reply carries for request entry
  // `request_index` of the pack's layer `layer_index`, ascending. `store` already holds the
  // pack's KV; `spec` passed Validate; `state` is the session's NewState (may be null).
  virtual Result<KvHeadSelection> Select(const CacheSelectorSpec& spec, const KvStore& store,
                                         const LayerPackView& pack, uint32_t layer_index,
                                         uint32_t request_index,
                                         CacheSelectorState* state) const = 0;

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
