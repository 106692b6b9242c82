// Two-segment sparse decode attention (see two_segment_attention.h): plain fp32 loops, in the
// same order and with the same arithmetic (Dot, softmax.h) as the rows path of attention.cc, so that a compact
// buffer holding every position before the recent segment reproduces dense decode bit for bit.
#include "kernels/cpu/two_segment_attention.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/softmax.h"

namespace rubato {
namespace {

Status Invalid(const std::string& message) {
  return InvalidArgumentError("two-segment attention: " + message);
}

}  // namespace

Status ValidateTwoSegmentAttention(const TwoSegmentAttentionArgs& args) {
  const PagedKvView& kv = args.kv;
  const CompactKvView& compact = args.compact;
  if (kv.num_kv_heads <= 0 || kv.head_dim <= 0 || kv.block_tokens <= 0) {
    return Invalid("paged KV shape (num_kv_heads " + std::to_string(kv.num_kv_heads) +
                   ", head_dim " + std::to_string(kv.head_dim) + ", block_tokens " +
                   std::to_string(kv.block_tokens) + ") must be positive");
  }
  if (args.num_heads <= 0 || args.num_heads % kv.num_kv_heads != 0) {
    return Invalid("num_heads " + std::to_string(args.num_heads) +
                   " is not a positive multiple of num_kv_heads " +
                   std::to_string(kv.num_kv_heads));
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
  if (args.recent_begin < 0 || args.recent_end < args.recent_begin) {
    return Invalid("recent segment [" + std::to_string(args.recent_begin) + ", " +
                   std::to_string(args.recent_end) + ") is not a range of positions");
  }
  const int64_t scratch =
      int64_t{compact.capacity} + (int64_t{args.recent_end} - args.recent_begin);
  if (scratch > INT_MAX) {
    return Invalid("compact capacity " + std::to_string(compact.capacity) + " + recent length " +
                   std::to_string(args.recent_end - args.recent_begin) + " exceeds INT_MAX");
  }
  if (args.query == nullptr || args.output == nullptr) return Invalid("query or output is null");
  if (args.compact_counts == nullptr) return Invalid("compact_counts is null");
  bool any_compact_row = false;
  for (int h = 0; h < kv.num_kv_heads; ++h) {
    const int count = args.compact_counts[h];
    if (count < 0 || count > compact.capacity) {
      return Invalid("compact_counts[" + std::to_string(h) + "] = " + std::to_string(count) +
                     " is outside [0, capacity " + std::to_string(compact.capacity) + "]");
    }
    any_compact_row = any_compact_row || count > 0;
  }
  if (any_compact_row && (compact.keys == nullptr || compact.values == nullptr)) {
    return Invalid("compact keys or values is null");
  }
  if (args.recent_end > args.recent_begin &&
      (kv.keys == nullptr || kv.values == nullptr || kv.block_table == nullptr)) {
    return Invalid("paged KV keys, values or block table is null");
  }
  return Status::Ok();
}

int TwoSegmentAttentionScratchSize(const TwoSegmentAttentionArgs& args) {
  return args.compact.capacity + (args.recent_end - args.recent_begin);
}

void TwoSegmentAttentionForKvHead(const TwoSegmentAttentionArgs& args, int kv_head,
                                  float* scratch) {
  const PagedKvView& kv = args.kv;
  const CompactKvView& compact = args.compact;
  const int head_dim = kv.head_dim;
  const int group = args.num_heads / kv.num_kv_heads;
  // head_dim ** -0.5 evaluated in double and rounded once, as in attention.cc.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int compact_rows = args.compact_counts[kv_head];
  const int num_keys = compact_rows + (args.recent_end - args.recent_begin);
  // [capacity][head_dim] slabs of this head; never formed when empty (the buffer may be null).
  const float* compact_keys =
      compact_rows > 0 ? compact.keys + compact.Offset(kv_head, 0) : nullptr;
  const float* compact_values =
      compact_rows > 0 ? compact.values + compact.Offset(kv_head, 0) : nullptr;

  // Calls fn(rows, packed, keys_or_values) for each contiguous run of the working set: the
  // compact rows, then each part of the recent segment that lies inside one KV block. `rows`
  // vectors of head_dim floats start at the pointer; packed counts the keys before the run.
  const auto for_each_run = [&](const float* compact_base, const float* paged_base, auto&& fn) {
    if (compact_rows > 0) fn(compact_rows, 0, compact_base);
    int packed = compact_rows;
    for (int first = args.recent_begin; first < args.recent_end;) {
      const int block_end = (first / kv.block_tokens + 1) * kv.block_tokens;
      const int rows = std::min(block_end, args.recent_end) - first;
      fn(rows, packed, paged_base + kv.Offset(first, kv_head));
      packed += rows;
      first += rows;
    }
  };

  for (int g = 0; g < group; ++g) {
    const int head = kv_head * group + g;
    const size_t row = static_cast<size_t>(head) * head_dim;
    const float* q = args.query + row;
    float* out = args.output + row;
    if (num_keys == 0) {  // empty working set: defined as output 0, lse -inf
      std::fill(out, out + head_dim, 0.0f);
      if (args.lse != nullptr) args.lse[head] = -INFINITY;
      continue;
    }

    // scratch: [num_keys] scores of the working set, packed: compact rows, then recent.
    for_each_run(compact_keys, kv.keys, [&](int rows, int packed, const float* keys) {
      for (int r = 0; r < rows; ++r) {
        scratch[packed + r] = Dot(q, keys + static_cast<size_t>(r) * head_dim, head_dim) * scale;
      }
    });
    const double lse = SoftmaxInPlaceWithLse(scratch, num_keys);
    if (args.lse != nullptr) args.lse[head] = static_cast<float>(lse);

    std::fill(out, out + head_dim, 0.0f);
    for_each_run(compact_values, kv.values, [&](int rows, int packed, const float* values) {
      for (int r = 0; r < rows; ++r) {
        const float prob = scratch[packed + r];
        const float* v = values + static_cast<size_t>(r) * head_dim;
        for (int d = 0; d < head_dim; ++d) out[d] += prob * v[d];
      }
    });
  }
}

Status TwoSegmentAttention(const TwoSegmentAttentionArgs& args, std::span<float> scratch) {
  RUBATO_RETURN_IF_ERROR(ValidateTwoSegmentAttention(args));
  const int needed = TwoSegmentAttentionScratchSize(args);
  if (scratch.size() < static_cast<size_t>(needed)) {
    return Invalid("scratch holds " + std::to_string(scratch.size()) + " floats, " +
                   std::to_string(needed) + " needed");
  }
  for (int h = 0; h < args.kv.num_kv_heads; ++h) {
    TwoSegmentAttentionForKvHead(args, h, scratch.data());
  }
  return Status::Ok();
}

}  // namespace rubato
