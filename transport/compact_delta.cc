// Delta replies' bookkeeping (compact_delta.h): the cache rank's slot map and the inference
// rank's compact pool.
#include "transport/compact_delta.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace rubato {

// ---- CompactSlotMap ---------------------------------------------------------------------------

Status CompactSlotMap::CheckSelection(std::span<const int32_t> selection) const {
  if (selection.size() > static_cast<size_t>(capacity_)) {
    return InvalidArgumentError(
        fmt::format("compact delta: {} positions selected, more than the "
                    "pool's capacity {}",
                    selection.size(), capacity_));
  }
  for (size_t i = 0; i < selection.size(); ++i) {
    if (selection[i] < 0 || (i > 0 && selection[i] <= selection[i - 1])) {
      return InvalidArgumentError(
          fmt::format("compact delta: selected position[{}] = {} is "
                      "negative or not ascending",
                      i, selection[i]));
    }
  }
  return Status::Ok();
}

Result<CompactDelta> CompactSlotMap::Reset(std::span<const int32_t> selection) {
  RUBATO_RETURN_IF_ERROR(CheckSelection(selection));
  CompactDelta delta;
  delta.reset = true;
  delta.count = static_cast<int>(selection.size());
  delta.positions.assign(selection.begin(), selection.end());
  delta.slots.resize(selection.size());
  for (size_t i = 0; i < selection.size(); ++i) delta.slots[i] = static_cast<int32_t>(i);
  slot_position_.assign(selection.begin(), selection.end());
  valid_ = true;
  return delta;
}

void CompactSlotMap::Clear() {
  valid_ = false;
  slot_position_.clear();
}

Result<CompactDelta> CompactSlotMap::Update(std::span<const int32_t> selection) {
  if (!valid_) return Reset(selection);
  RUBATO_RETURN_IF_ERROR(CheckSelection(selection));
  const int count = static_cast<int>(selection.size());
  // Rows that stay where they are: selected again, in a slot below the new count.
  std::vector<bool> kept_position(selection.size(), false);  // [selection]
  std::vector<bool> slot_taken(static_cast<size_t>(count), false);
  for (int slot = 0; slot < std::min(count, this->count()); ++slot) {
    const auto found = std::lower_bound(selection.begin(), selection.end(), slot_position_[slot]);
    if (found == selection.end() || *found != slot_position_[slot]) continue;
    kept_position[static_cast<size_t>(found - selection.begin())] = true;
    slot_taken[static_cast<size_t>(slot)] = true;
  }
  CompactDelta delta;
  delta.count = count;
  slot_position_.resize(static_cast<size_t>(count), -1);
  int free_slot = 0;
  for (size_t i = 0; i < selection.size(); ++i) {
    if (kept_position[i]) continue;
    while (slot_taken[static_cast<size_t>(free_slot)]) ++free_slot;  // one exists: counts match
    slot_taken[static_cast<size_t>(free_slot)] = true;
    slot_position_[static_cast<size_t>(free_slot)] = selection[i];
    delta.slots.push_back(free_slot);
    delta.positions.push_back(selection[i]);
  }
  return delta;
}

// ---- CompactPool ------------------------------------------------------------------------------

CompactPool::CompactPool(int num_kv_heads, int capacity, int head_dim)
    : num_kv_heads_(num_kv_heads),
      capacity_(capacity),
      head_dim_(head_dim),
      counts_(static_cast<size_t>(num_kv_heads), 0),
      positions_(static_cast<size_t>(num_kv_heads) * capacity, -1),
      keys_(static_cast<size_t>(num_kv_heads) * capacity * head_dim, 0.0f),
      values_(keys_.size(), 0.0f) {}

std::span<const int32_t> CompactPool::positions(int kv_head) const {
  return {positions_.data() + static_cast<size_t>(kv_head) * capacity_,
          static_cast<size_t>(counts_[static_cast<size_t>(kv_head)])};
}

Status CompactPool::Apply(int kv_head, bool reset, int count, std::span<const int32_t> slots,
                          std::span<const int32_t> positions, std::span<const float> keys,
                          std::span<const float> values) {
  const auto bad = [&](const std::string& what) {
    return DataLossError(fmt::format("compact pool: KV head {}: {}", kv_head, what));
  };
  if (kv_head < 0 || kv_head >= num_kv_heads_) {
    return InvalidArgumentError(
        fmt::format("compact pool: KV head {} outside [0, {})", kv_head, num_kv_heads_));
  }
  if (count < 0 || count > capacity_) {
    return bad(fmt::format("'count' {} outside [0, capacity {}]", count, capacity_));
  }
  const size_t rows = slots.size();
  const size_t row_floats = static_cast<size_t>(head_dim_);
  if (positions.size() != rows || keys.size() != rows * row_floats ||
      values.size() != rows * row_floats) {
    return bad(fmt::format("{} slots, {} positions, {} key and {} value floats (head_dim {})", rows,
                           positions.size(), keys.size(), values.size(), head_dim_));
  }
  // A slot below the count is filled after the delta if it was in use before (and no reset)
  // or a row enters it; each slot is written at most once.
  const int before = reset ? 0 : std::min(counts_[static_cast<size_t>(kv_head)], count);
  std::vector<bool> written(static_cast<size_t>(count), false);
  for (size_t i = 0; i < rows; ++i) {
    if (slots[i] < 0 || slots[i] >= count) {
      return bad(fmt::format("'slots[{}]' = {} outside [0, count {})", i, slots[i], count));
    }
    if (written[static_cast<size_t>(slots[i])]) {
      return bad(fmt::format("slot {} is written twice", slots[i]));
    }
    if (positions[i] < 0) return bad(fmt::format("'positions[{}]' = {}", i, positions[i]));
    written[static_cast<size_t>(slots[i])] = true;
  }
  for (int slot = before; slot < count; ++slot) {
    if (!written[static_cast<size_t>(slot)]) {
      return bad(fmt::format("slot {} of the {} in use is left empty", slot, count));
    }
  }
  int32_t* head_positions = positions_.data() + static_cast<size_t>(kv_head) * capacity_;
  for (int slot = count; slot < capacity_; ++slot) head_positions[slot] = -1;
  for (size_t i = 0; i < rows; ++i) {
    const size_t slot = static_cast<size_t>(slots[i]);
    head_positions[slot] = positions[i];
    const size_t at = (static_cast<size_t>(kv_head) * capacity_ + slot) * row_floats;
    std::memcpy(keys_.data() + at, keys.data() + i * row_floats, row_floats * sizeof(float));
    std::memcpy(values_.data() + at, values.data() + i * row_floats, row_floats * sizeof(float));
  }
  counts_[static_cast<size_t>(kv_head)] = count;
  return Status::Ok();
}

}  // namespace rubato
