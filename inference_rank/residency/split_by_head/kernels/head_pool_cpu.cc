// The CPU twin of the device pool's bookkeeping (see head_pool_cpu.h).
#include "inference_rank/residency/split_by_head/kernels/head_pool_cpu.h"

#include <algorithm>

namespace rubato {

HeadPoolMoves HeadPoolInstallCpu(const HeadPoolBookRow& b, const std::vector<int32_t>& statics,
                                 const std::vector<int32_t>& selected) {
  std::fill(b.row_of, b.row_of + b.context_capacity, -1);
  const int s = std::min<int>(static_cast<int>(statics.size()), b.pool_capacity);
  const int d = std::min<int>(static_cast<int>(selected.size()), b.pool_capacity - s);
  HeadPoolMoves moves;
  for (int i = 0; i < s + d; ++i) {
    const int position = i < s ? statics[i] : selected[i - s];
    b.positions[i] = position;
    moves.rows.push_back(i);
    moves.positions.push_back(position);
    if (position >= 0 && position < b.context_capacity) b.row_of[position] = i;
  }
  b.sizes[0] = s;
  b.sizes[1] = d;
  return moves;
}

HeadPoolMoves HeadPoolAnticipateCpu(const HeadPoolBookRow& b,
                                    const std::vector<int32_t>& selected) {
  const int statics = b.sizes[0], old = b.sizes[1];
  const auto in_range = [&](int p) { return p >= 0 && p < b.context_capacity; };
  std::vector<int32_t> freed;
  for (int j = statics; j < statics + old; ++j) {
    if (!std::binary_search(selected.begin(), selected.end(), b.positions[j])) freed.push_back(j);
  }
  int new_total = 0;
  for (int32_t p : selected) new_total += in_range(p) && b.row_of[p] < 0;
  const int free_used = std::min<int>(static_cast<int>(freed.size()), new_total);
  for (int r = 0; r < free_used; ++r) {
    if (in_range(b.positions[freed[r]])) b.row_of[b.positions[freed[r]]] = -1;
  }
  HeadPoolMoves moves;
  int rank = 0;
  for (int32_t p : selected) {
    if (!in_range(p) || b.row_of[p] >= 0) continue;
    const int target = rank < free_used ? freed[rank] : statics + old + (rank - free_used);
    if (target < b.pool_capacity) {
      b.positions[target] = p;
      b.row_of[p] = target;
      moves.rows.push_back(target);
    } else {
      moves.rows.push_back(-1);
    }
    moves.positions.push_back(p);
    ++rank;
  }
  b.sizes[1] = std::min(old + new_total - free_used, b.pool_capacity - statics);
  return moves;
}

}  // namespace rubato
