// Compact gather (see compact_gather.h): every check first, then plain row copies.
#include "kernels/cpu/compact_gather.h"

#include <algorithm>
#include <cstddef>
#include <string>

namespace rubato {
namespace {

Status Invalid(const std::string& message) {
  return InvalidArgumentError("compact gather: " + message);
}

Status ValidateGather(const PagedKvView& kv, int num_tokens,
                      std::span<const std::vector<int>> positions, const CompactKvView& compact,
                      std::span<int> counts) {
  if (kv.num_kv_heads <= 0 || kv.head_dim <= 0 || kv.block_tokens <= 0) {
    return Invalid("paged KV shape (num_kv_heads " + std::to_string(kv.num_kv_heads) +
                   ", head_dim " + std::to_string(kv.head_dim) + ", block_tokens " +
                   std::to_string(kv.block_tokens) + ") must be positive");
  }
  if (compact.num_kv_heads != kv.num_kv_heads || compact.head_dim != kv.head_dim) {
    return Invalid("compact buffer has " + std::to_string(compact.num_kv_heads) +
                   " KV heads of head_dim " + std::to_string(compact.head_dim) +
                   " but the paged KV has " + std::to_string(kv.num_kv_heads) + " of " +
                   std::to_string(kv.head_dim));
  }
  if (compact.capacity < 0) {
    return Invalid("compact capacity " + std::to_string(compact.capacity) + " < 0");
  }
  if (num_tokens < 0) return Invalid("num_tokens " + std::to_string(num_tokens) + " < 0");
  const size_t heads = static_cast<size_t>(kv.num_kv_heads);
  if (positions.size() != heads || counts.size() != heads) {
    return Invalid(std::to_string(positions.size()) + " position lists and " +
                   std::to_string(counts.size()) + " counts for " + std::to_string(heads) +
                   " KV heads");
  }
  bool any_position = false;
  for (size_t h = 0; h < heads; ++h) {
    const std::vector<int>& kept = positions[h];
    const std::string head = "kv head " + std::to_string(h);
    if (kept.size() > static_cast<size_t>(compact.capacity)) {
      return Invalid(head + " keeps " + std::to_string(kept.size()) +
                     " positions but the compact capacity is " + std::to_string(compact.capacity));
    }
    for (size_t i = 0; i < kept.size(); ++i) {
      if (kept[i] < 0 || kept[i] >= num_tokens) {
        return Invalid(head + ": position " + std::to_string(kept[i]) + " (entry " +
                       std::to_string(i) + ") is outside the sequence's [0, " +
                       std::to_string(num_tokens) + ")");
      }
      if (i > 0 && kept[i] <= kept[i - 1]) {
        return Invalid(head + ": position " + std::to_string(kept[i]) + " (entry " +
                       std::to_string(i) + ") does not follow " + std::to_string(kept[i - 1]) +
                       " (positions must be strictly ascending)");
      }
    }
    any_position = any_position || !kept.empty();
  }
  if (any_position && (kv.keys == nullptr || kv.values == nullptr || kv.block_table == nullptr)) {
    return Invalid("paged KV keys, values or block table is null");
  }
  if (any_position && (compact.keys == nullptr || compact.values == nullptr)) {
    return Invalid("compact keys or values is null");
  }
  return Status::Ok();
}

}  // namespace

Status GatherCompactKv(const PagedKvView& kv, int num_tokens,
                       std::span<const std::vector<int>> positions, const CompactKvView& compact,
                       std::span<int> counts) {
  RUBATO_RETURN_IF_ERROR(ValidateGather(kv, num_tokens, positions, compact, counts));
  const size_t head_dim = static_cast<size_t>(kv.head_dim);
  for (int h = 0; h < kv.num_kv_heads; ++h) {
    const std::vector<int>& kept = positions[static_cast<size_t>(h)];
    for (size_t row = 0; row < kept.size(); ++row) {
      const size_t source = kv.Offset(kept[row], h);
      const size_t destination = compact.Offset(h, static_cast<int>(row));
      std::copy_n(kv.keys + source, head_dim, compact.keys + destination);
      std::copy_n(kv.values + source, head_dim, compact.values + destination);
    }
    counts[static_cast<size_t>(h)] = static_cast<int>(kept.size());
  }
  return Status::Ok();
}

}  // namespace rubato
