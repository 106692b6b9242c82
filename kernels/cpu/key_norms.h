// Key norms: the L2 norm of the cached key of every KV head at a range of positions of one
// sequence, the input of the SFI Selector's key-norm prior (paper Eq. 9, `gamma > 0`;
// docs/design.md §4.2). The sum of squares is taken in double and rounded once to f32.
//
// CUDA twin: kernels/cuda/key_norms.cuh (bf16 keys, a batch of sequences, f32 sums, rows indexed
// by position as SfiSelect reads them); given the same key values the two agree to f32 rounding.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "kernels/cpu/paged_kv_view.h"

namespace rubato {

// kv:           the sequence's keys of one layer; its block table covers [begin, begin + count).
// begin, count: the positions, begin >= 0, count >= 0.
// norms:        [kv.num_kv_heads][norms_stride] out: norms[h * norms_stride + i] = |K(h, begin + i)|
//               for i < count; entries [count, norms_stride) of each row are left as they were.
// InvalidArgument, naming the problem, on a missing pointer, a bad shape, negative begin / count
// or norms_stride < count; nothing is written then.
Status KeyNorms(const PagedKvView& kv, int begin, int count, float* norms, int64_t norms_stride);

}  // namespace rubato
