// AsyncSpade's query rings, the CPU twins (see query_rings.h).
#include "cache_rank/query_rings.h"

#include <algorithm>

#include "common/dtype.h"

namespace rubato {

void PushQueryRowsCpu(std::span<float> ring, std::span<int32_t> next, std::span<int32_t> count,
                      std::span<const uint16_t> rows, int64_t row_stride,
                      const QueryRingEntries& entries, int slots, int heads, int capacity,
                      int dim) {
  for (size_t e = 0; e < entries.slot.size(); ++e) {
    const int slot = entries.slot[e];
    if (slot < 0 || slot >= slots) continue;
    for (int h = 0; h < heads; ++h) {
      const size_t ring_index = static_cast<size_t>(slot) * heads + h;
      int32_t at = next[ring_index];
      int32_t held = count[ring_index];
      if (entries.restart[e] != 0 || at < 0 || at >= capacity) {
        at = 0;
        held = 0;
      }
      const uint16_t* q = rows.data() + entries.row[e] * row_stride + static_cast<int64_t>(h) * dim;
      float* to = ring.data() + (ring_index * capacity + static_cast<size_t>(at)) * dim;
      for (int d = 0; d < dim; ++d) to[d] = Bf16ToF32(q[d]);
      next[ring_index] = (at + 1) % capacity;
      count[ring_index] = std::min(std::max(held, 0) + 1, capacity);
    }
  }
}

void PackPredictedQueriesCpu(std::span<const float> predicted, std::span<const int32_t> slot,
                             int slots, int heads, int dim, int64_t out_stride,
                             std::span<uint16_t> out) {
  const size_t row = static_cast<size_t>(heads) * dim;
  for (size_t e = 0; e < slot.size(); ++e) {
    uint16_t* to = out.data() + static_cast<int64_t>(e) * out_stride;
    if (slot[e] < 0 || slot[e] >= slots) {
      std::fill(to, to + row, uint16_t{0});
      continue;
    }
    const float* from = predicted.data() + static_cast<size_t>(slot[e]) * row;
    for (size_t i = 0; i < row; ++i) to[i] = F32ToBf16(from[i]);
  }
}

}  // namespace rubato
