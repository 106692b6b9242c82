// Paged KV append: writes the keys and values of new tokens of one sequence into its blocks.
#pragma once

#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

// Positions [start_position, start_position + tokens) of the sequence get the new K and V.
//   keys, values: [tokens][num_kv_heads][head_dim], f32 (after RoPE for keys)
// The block table of `kv` must cover every written position; the caller reserves blocks.
void AppendToPagedKv(const float* keys, const float* values, int tokens, int start_position,
                     const PagedKvView& kv);

}  // namespace rubato
