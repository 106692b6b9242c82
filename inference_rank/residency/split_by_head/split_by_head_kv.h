// One request's KV under the split_by_head residency (docs/synckv.md, docs/residency.md): the
// representative heads' (R-heads') KV stays whole in the paged cache; the other heads'
// (NR-heads') full KV goes to an offloaded store, and what they attend locally is a front of
// rows (the static set and the current dynamic set of their cluster, ascending by position)
// plus the positions since the last selection, read in place. The policy decides the sets
// (SelectInitial at the prompt's end, Anticipate every m steps); this object moves the rows:
// an anticipation's rows already local are copied at once, the others fetched asynchronously
// into a buffer nobody reads, swapped in at the first step after the anticipation (the step
// waits for it if it is late: the exposed fetch wait).
#pragma once

#include <atomic>
#include <cstdint>
#include <future>
#include <vector>

#include "common/status.h"
#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/attention/head_split.h"
#include "inference_rank/residency/residency_backend.h"
#include "inference_rank/residency/split_by_head/kv_fetcher.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

struct SplitByHeadCounters {
  std::atomic<int64_t> fetches{0};          // anticipations that fetched, per (request, layer)
  std::atomic<int64_t> rows_fetched{0};     // (NR-head, position) rows read from the store
  std::atomic<int64_t> bytes_fetched{0};    // their K and V bytes (f32 on the CPU engine)
  std::atomic<int64_t> rows_reused{0};      // rows of a new dynamic set already local (the delta)
  std::atomic<int64_t> rows_offloaded{0};   // NR-head rows written to the store
  std::atomic<int64_t> exposed_wait_ns{0};  // steps waiting for a late fetch
  // The last forward's decode entries: K/V bytes held locally for them (R-heads' full rows,
  // NR-heads' front and recent rows) and their full KV's bytes, over every layer.
  std::atomic<int64_t> local_kv_bytes{0};
  std::atomic<int64_t> full_kv_bytes{0};
};

class SplitByHeadKv {
 public:
  // `capacity`: positions the request may reach (the store is allocated once, so a fetch in
  // flight never sees it move). `split`, `fetcher` and `counters` outlive this object.
  SplitByHeadKv(const HeadSplit& split, int head_dim, int capacity, KvFetcher& fetcher,
                SplitByHeadCounters& counters);
  ~SplitByHeadKv();  // waits for fetches in flight: they write its buffers
  SplitByHeadKv(const SplitByHeadKv&) = delete;
  SplitByHeadKv& operator=(const SplitByHeadKv&) = delete;

  // ---- the policy's decisions, before the layer's attention (applied by ApplySelection) ----
  // The prompt's end: per cluster the static set and the initial dynamic set (disjoint).
  void SelectInitial(int layer, std::vector<std::vector<int>> static_sets,
                     std::vector<std::vector<int>> dynamic_sets);
  // An anticipation step: per cluster the next dynamic set, attended from the next step.
  void Anticipate(int layer, std::vector<std::vector<int>> dynamic_sets);
  // Ascending; empty before SelectInitial was applied.
  const std::vector<int>& StaticSet(int layer, int cluster) const;
  // Whether the prompt's selection of `layer` is installed (the request decodes).
  bool Installed(int layer) const { return layers_[layer].installed; }

  // ---- the residency's model half, per layer, in this order ----
  // A decode step at `position`: a fetch selected at an earlier step is waited for and swapped
  // in (the dynamic sets it carries become the front).
  Status BeginStep(int layer, int position);
  // The NR-heads' new rows into the store: k, v [tokens][num_kv_heads][head_dim].
  Status Offload(int layer, const float* k, const float* v, int start_position, int tokens);
  // The pending selection of `layer`, made at `position`: an initial one installs the front from
  // the store; an anticipation copies its local rows (front, recent in `kv`) and fetches the rest.
  Status ApplySelection(int layer, const PagedKvView& kv, int position);

  // What the NR-heads attend beside the positions [recent_begin(layer), position]: the front
  // (counts 0 for R-heads). Valid until the layer's next BeginStep / ApplySelection.
  CompactSegment Front(int layer) const;
  int recent_begin(int layer) const { return layers_[layer].recent_begin; }
  // K/V bytes held locally for a step at `position` of `layer`, and the full KV's.
  int64_t LocalBytes(int layer, int position) const;
  int64_t FullBytes(int position) const;

 private:
  struct Incoming {  // a fetch in flight: the next dynamic sets' rows
    bool active = false;
    int selected_at = 0;
    std::vector<std::vector<int>> sets;            // [cluster], ascending
    std::vector<std::vector<float>> keys, values;  // [kv_head][rows][head_dim] (NR-heads)
    std::shared_future<void> done;
  };
  struct Layer {
    std::vector<float> store_keys, store_values;  // [nr][capacity][head_dim], the NR-heads
    std::vector<float> front_keys, front_values;  // [kv_heads][front_capacity][head_dim]
    int front_capacity = 1;
    std::vector<int> counts;                        // [kv_heads]
    std::vector<std::vector<int>> front_positions;  // [kv_heads], ascending
    int recent_begin = 0;
    bool installed = false;
    std::vector<std::vector<int>> static_sets;                   // [cluster], ascending
    std::vector<std::vector<float>> static_keys, static_values;  // [kv_head][rows][head_dim]
    bool initial_pending = false, anticipation_pending = false;
    std::vector<std::vector<int>> pending_static, pending_dynamic;
    Incoming incoming;
  };

  // Of (NR-head `kv_head`, `position`) in a layer's store_keys / store_values.
  size_t StoreOffset(int layer, int kv_head, int position) const;
  // The front of every NR-head: the merge, by position, of its static rows and the rows of
  // `sets` (its cluster's), whose K/V are `keys[kv_head]`, `values[kv_head]` in set order.
  void RebuildFront(Layer& layer, int layer_index, const std::vector<std::vector<int>>& sets,
                    const std::vector<std::vector<float>>& keys,
                    const std::vector<std::vector<float>>& values);

  const HeadSplit& split_;
  int head_dim_, capacity_, kv_heads_;
  KvFetcher& fetcher_;
  SplitByHeadCounters& counters_;
  std::vector<int> nr_index_;  // [layer * kv_heads + h]: its slot in the store, -1 for R-heads
  std::vector<Layer> layers_;
};

// The handle the residency sets on a request's forward entries (ForwardEntry::residency); the
// policy's backend half reaches the request's SplitByHeadKv through it.
struct SplitByHeadEntry final : public ResidencyEntry {
  SplitByHeadKv* kv = nullptr;
};

}  // namespace rubato
