// Delta replies of a row-selecting cache selector (oracle_topk): instead of every selected row,
// each step the cache rank sends only the rows entering a KV head's selection, each with the
// slot it takes in the inference rank's persistent compact pool. Both halves of that
// bookkeeping live here: CompactSlotMap on the cache rank (which position sits in which slot)
// and CompactPool on the inference rank (the rows themselves). Applying every delta to a pool
// rebuilds exactly the rows a full reply carries, as a set of (position, row) pairs; the pool's
// rows are in slot order, not position order. Wire sections: layer_pack.h (delta replies);
// narrative: docs/disaggregated.md "Delta replies".
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace rubato {

// What one KV head's pool must do this step: empty itself first when `reset` (a full reply),
// then write row i of the entering rows into slot slots[i] (position positions[i]). After it the
// pool's rows in use are slots [0, count): the cache rank keeps the pool dense.
struct CompactDelta {
  bool reset = false;
  int count = 0;
  std::vector<int32_t> slots;      // [entering], distinct, each < count
  std::vector<int32_t> positions;  // [entering], strictly ascending
};

// The cache rank's map of one (session, layer, KV head) pool of `capacity` slots: the position
// in each slot in use. Update turns the previous selection's pool into the next one's.
class CompactSlotMap {
 public:
  explicit CompactSlotMap(int capacity) : capacity_(capacity) {}

  // The delta to the pool of the last selection (a reset after construction or Clear) that
  // holds exactly `selection` (strictly ascending, at most capacity positions): rows that stay
  // keep their slot; entering rows take the slots freed by rows that left, lowest first, then
  // the slots past the old count; a row in a slot at or past the new count moves down (it is
  // sent again as entering) so that the pool stays dense.
  Result<CompactDelta> Update(std::span<const int32_t> selection);
  // The delta of a full reply: every row of `selection` enters, slot i taking selection[i].
  Result<CompactDelta> Reset(std::span<const int32_t> selection);
  // Forgets the pool (its next Update is a full reply).
  void Clear();

  int capacity() const { return capacity_; }
  int count() const { return static_cast<int>(slot_position_.size()); }
  // The position in each slot in use: [count].
  std::span<const int32_t> slot_positions() const { return slot_position_; }

 private:
  Status CheckSelection(std::span<const int32_t> selection) const;

  int capacity_;
  bool valid_ = false;                  // the peer's pool holds what slot_position_ says
  std::vector<int32_t> slot_position_;  // [count]: the position in each slot in use
};

// The inference rank's persistent compact pool of one (session, layer): per KV head `capacity`
// slots of f32 K and V rows and their positions, as the CompactKvView layout
// ([kv_head][capacity][head_dim]) so the model's two-segment attention reads it in place.
class CompactPool {
 public:
  CompactPool(int num_kv_heads, int capacity, int head_dim);

  // Applies KV head `kv_head`'s delta: `keys` / `values` are its entering rows
  // ([slots.size()][head_dim], f32). Refuses (naming the field) a count past the capacity, a
  // slot at or past the count, a slot written twice, and a delta that leaves a slot below the
  // count empty; the pool is unchanged then.
  Status Apply(int kv_head, bool reset, int count, std::span<const int32_t> slots,
               std::span<const int32_t> positions, std::span<const float> keys,
               std::span<const float> values);
  Status Apply(int kv_head, const CompactDelta& delta, std::span<const float> keys,
               std::span<const float> values) {
    return Apply(kv_head, delta.reset, delta.count, delta.slots, delta.positions, keys, values);
  }

  int num_kv_heads() const { return num_kv_heads_; }
  int capacity() const { return capacity_; }
  int head_dim() const { return head_dim_; }
  // [num_kv_heads]: rows in use per head (slots [0, count)).
  const int* counts() const { return counts_.data(); }
  // [num_kv_heads][capacity][head_dim], f32.
  float* keys() { return keys_.data(); }
  float* values() { return values_.data(); }
  // The position in each slot of `kv_head` in use: [count].
  std::span<const int32_t> positions(int kv_head) const;

 private:
  int num_kv_heads_;
  int capacity_;
  int head_dim_;
  std::vector<int> counts_;         // [num_kv_heads]
  std::vector<int32_t> positions_;  // [num_kv_heads][capacity], -1: empty
  std::vector<float> keys_;         // [num_kv_heads][capacity][head_dim]
  std::vector<float> values_;       // same
};

}  // namespace rubato
