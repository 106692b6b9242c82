// How CPU ops see one sequence's keys and values of one layer in a paged KV cache
// (docs/design.md §3): fixed-size blocks of `block_tokens` positions, found through the sequence's
// block table. Token at position p lives in physical block block_table[p / block_tokens], at
// row p % block_tokens of every KV head's slab in that block.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rubato {

struct PagedKvView {
  float* keys = nullptr;    // [num_blocks][num_kv_heads][block_tokens][head_dim], f32 (one layer)
  float* values = nullptr;  // [num_blocks][num_kv_heads][block_tokens][head_dim], f32 (one layer)
  const int32_t* block_table = nullptr;  // [ceil(positions / block_tokens)] physical block ids
  int block_tokens = 0;
  int num_kv_heads = 0;
  int head_dim = 0;

  // Offset, in floats, of the [head_dim] vector of `kv_head` at sequence position `position`.
  size_t Offset(int position, int kv_head) const {
    const size_t block = static_cast<size_t>(block_table[position / block_tokens]);
    const size_t row = static_cast<size_t>(position % block_tokens);
    return ((block * num_kv_heads + kv_head) * block_tokens + row) * head_dim;
  }
};

}  // namespace rubato
