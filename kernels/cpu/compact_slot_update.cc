// Compact slot update on the CPU (compact_slot_update.h), written the way the CUDA twin computes
// it: kept flags from a binary search of each old slot's position, then ranks of the entering
// rows and of the free slots.
#include "kernels/cpu/compact_slot_update.h"

#include <algorithm>
#include <string>
#include <vector>

namespace rubato {
namespace {

Status Check(const CompactSlotUpdateArgs& a) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("CompactSlotUpdate: " + what);
  };
  if (a.batch < 0 || a.num_kv_heads < 1 || a.num_maps < 0 || a.max_sink_tokens < 0 ||
      a.budget < 0) {
    return invalid("batch " + std::to_string(a.batch) + ", num_kv_heads " +
                   std::to_string(a.num_kv_heads) + ", num_maps " + std::to_string(a.num_maps) +
                   ", max_sink_tokens " + std::to_string(a.max_sink_tokens) + ", budget " +
                   std::to_string(a.budget) +
                   ": need batch, num_maps, sink, budget >= 0 and "
                   "num_kv_heads >= 1");
  }
  if (a.capacity < 1 || a.capacity < a.max_sink_tokens + a.budget) {
    return invalid("capacity = " + std::to_string(a.capacity) +
                   " must be >= 1 and hold max_sink_tokens + budget = " +
                   std::to_string(a.max_sink_tokens + a.budget));
  }
  if (a.batch == 0) return Status::Ok();
  if (a.maps == nullptr || a.map_index == nullptr || a.sink_end == nullptr ||
      a.selected_count == nullptr || (a.selected == nullptr && a.budget > 0) ||
      a.counts == nullptr || a.entering == nullptr || a.entering_slots == nullptr ||
      a.entering_positions == nullptr) {
    return invalid(
        "maps, map_index, sink_end, selected, selected_count, counts, entering, "
        "entering_slots and entering_positions must be set");
  }
  for (int b = 0; b < a.batch; ++b) {
    if (a.map_index[b] < 0 || a.map_index[b] >= a.num_maps) {
      return invalid("map_index[" + std::to_string(b) + "] = " + std::to_string(a.map_index[b]) +
                     " outside [0, num_maps " + std::to_string(a.num_maps) + ")");
    }
    const int sink = std::clamp(a.sink_end[b], 0, a.max_sink_tokens);
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const int64_t pair = int64_t{b} * a.num_kv_heads + h;
      const int chosen = std::clamp(a.selected_count[pair], 0, a.budget);
      int64_t previous = sink - 1;
      for (int i = 0; i < chosen; ++i) {
        const int32_t position = a.selected[pair * a.budget + i];
        if (position <= previous) {
          return invalid("sequence " + std::to_string(b) + ", KV head " + std::to_string(h) +
                         ": selected[" + std::to_string(i) + "] = " + std::to_string(position) +
                         " is not above " + std::to_string(previous) +
                         " (the selection must be strictly ascending after the sink rows)");
        }
        previous = position;
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status CompactSlotUpdate(const CompactSlotUpdateArgs& a) {
  RUBATO_RETURN_IF_ERROR(Check(a));
  const int64_t map_stride = int64_t{1} + a.capacity;
  std::vector<int32_t> selection;  // the new selection of one (b, h)
  std::vector<uint8_t> kept, taken;
  std::vector<int32_t> free_slots;
  for (int b = 0; b < a.batch; ++b) {
    const int sink = std::clamp(a.sink_end[b], 0, a.max_sink_tokens);
    const bool reset = a.reset != nullptr && a.reset[b] != 0;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const int64_t pair = int64_t{b} * a.num_kv_heads + h;
      int32_t* map = a.maps + (int64_t{a.map_index[b]} * a.num_kv_heads + h) * map_stride;
      const int chosen = std::clamp(a.selected_count[pair], 0, a.budget);
      selection.resize(static_cast<size_t>(sink + chosen));
      for (int i = 0; i < sink; ++i) selection[static_cast<size_t>(i)] = i;
      for (int i = 0; i < chosen; ++i) {
        selection[static_cast<size_t>(sink + i)] = a.selected[pair * a.budget + i];
      }
      const int count = sink + chosen;
      const int old_count = reset ? 0 : std::clamp(map[0], 0, a.capacity);
      // Kept: an old slot below the new count whose position is selected again.
      kept.assign(static_cast<size_t>(count), 0);
      taken.assign(static_cast<size_t>(count), 0);
      for (int s = 0; s < std::min(count, old_count); ++s) {
        const auto found = std::lower_bound(selection.begin(), selection.end(), map[1 + s]);
        if (found == selection.end() || *found != map[1 + s]) continue;
        kept[static_cast<size_t>(found - selection.begin())] = 1;
        taken[static_cast<size_t>(s)] = 1;
      }
      // The i-th free slot (ascending) takes the i-th entering row (ascending by position).
      free_slots.clear();
      for (int s = 0; s < count; ++s) {
        if (taken[static_cast<size_t>(s)] == 0) free_slots.push_back(s);
      }
      int32_t* slots_out = a.entering_slots + pair * a.capacity;
      int32_t* positions_out = a.entering_positions + pair * a.capacity;
      int entering = 0;
      for (int i = 0; i < count; ++i) {
        if (kept[static_cast<size_t>(i)] != 0) continue;
        const int32_t slot = free_slots[static_cast<size_t>(entering)];
        slots_out[entering] = slot;
        positions_out[entering] = selection[static_cast<size_t>(i)];
        map[1 + slot] = selection[static_cast<size_t>(i)];
        ++entering;
      }
      std::fill(slots_out + entering, slots_out + a.capacity, -1);
      std::fill(positions_out + entering, positions_out + a.capacity, -1);
      map[0] = count;
      a.counts[pair] = count;
      a.entering[pair] = entering;
    }
  }
  return Status::Ok();
}

}  // namespace rubato
