// Which KV heads of each layer are representative (R-heads: their KV stays whole on the
// inference rank) and which cluster each head follows (the NR-heads attend their cluster's
// selection): what a policy declares for the split_by_head residency by implementing
// HeadSplitPolicy beside AttentionPolicy (SyncKV, docs/synckv.md). The residency reads it to
// know which heads' KV it offloads, and refuses a policy that names none.
#pragma once

#include <string>
#include <vector>

namespace rubato {

struct HeadSplit {
  int num_layers = 0;
  int num_kv_heads = 0;
  std::vector<std::vector<int>> cluster;         // [layer][kv_head] in [0, clusters(layer))
  std::vector<std::vector<int>> representative;  // [layer][cluster]: its R-head

  int clusters(int layer) const { return static_cast<int>(representative[layer].size()); }
  bool IsRepresentative(int layer, int kv_head) const {
    return representative[layer][cluster[layer][kv_head]] == kv_head;
  }
  // The R-head whose selection `kv_head` of `layer` attends (itself for an R-head).
  int RepresentativeOf(int layer, int kv_head) const {
    return representative[layer][cluster[layer][kv_head]];
  }
};

// Where the NR-heads' full KV lives on the CUDA model: pinned host memory of this process
// ("host"), or the memory of another GPU of this process ("device", `device`), read by peer
// access. `fetch_delay_ns`: tests, each fetch waits this long on its copy stream.
struct HeadSplitStore {
  std::string where = "host";
  int device = 1;
  unsigned int fetch_delay_ns = 0;
};

// The capability a policy adds to declare its split (the residency asks by dynamic_cast).
class HeadSplitPolicy {
 public:
  virtual ~HeadSplitPolicy() = default;
  virtual const HeadSplit& head_split() const = 0;
  // Positions each NR-head keeps locally (static + dynamic) for a context of `context`: the
  // device pool's rows (CUDA).
  virtual int KeptPositions(int context) const = 0;
  // The most positions before the current one that the NR-heads read in place (the recent
  // segment since the last selection): the CUDA model's local window.
  virtual int RecentPositions() const = 0;
  virtual HeadSplitStore store() const { return HeadSplitStore(); }
};

}  // namespace rubato
