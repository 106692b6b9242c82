// The CPU twin of head_pool.cuh: the device pool's bookkeeping and row copies for one
// (row, cluster), on host arrays of the same layouts, bf16 rows as their 16-bit patterns. The
// GPU ops must give the same integers and the same bits (tests/gpu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace rubato {

// One (slot, cluster)'s book: positions [pool_capacity], row_of [context_capacity], sizes {S, D}.
struct HeadPoolBookRow {
  int32_t* positions = nullptr;
  int32_t* row_of = nullptr;
  int32_t* sizes = nullptr;
  int pool_capacity = 0;
  int context_capacity = 0;
};

struct HeadPoolMoves {
  std::vector<int32_t> rows, positions;  // move i writes pool row rows[i] with positions[i]
};

// Install: `statics` in rows [0, S), `selected` after them. Returns the moves; the attended
// count is sizes[0] + sizes[1].
HeadPoolMoves HeadPoolInstallCpu(const HeadPoolBookRow& book, const std::vector<int32_t>& statics,
                                 const std::vector<int32_t>& selected);
// Anticipation: `selected` ascending, the new dynamic set.
HeadPoolMoves HeadPoolAnticipateCpu(const HeadPoolBookRow& book,
                                    const std::vector<int32_t>& selected);

// The moves' rows of one NR-head from `source_row(position)` (a pointer to head_dim 16-bit
// values) into `pool` [pool_capacity][head_dim]; only the moves `take(position)` accepts.
template <typename Source, typename Take>
int HeadPoolCopyCpu(const HeadPoolMoves& moves, int head_dim, Source source_row, Take take,
                    uint16_t* pool) {
  int copied = 0;
  for (size_t m = 0; m < moves.rows.size(); ++m) {
    if (moves.rows[m] < 0 || moves.positions[m] < 0 || !take(moves.positions[m])) continue;
    const uint16_t* from = source_row(moves.positions[m]);
    for (int x = 0; x < head_dim; ++x)
      pool[static_cast<int64_t>(moves.rows[m]) * head_dim + x] = from[x];
    ++copied;
  }
  return copied;
}

}  // namespace rubato
