// Key norms on the GPU: the L2 norm of the cached key of every KV head at positions
// [begin[b], begin[b] + count[b]) of each sequence b of a batch, out of the paged key pool; the
// input of SfiSelect's key-norm prior (paper Eq. 9, `gamma > 0`; docs/design.md §4.2). CPU twin:
// kernels/cpu/key_norms.h (one sequence, f32 keys, rows indexed from `begin`); this op writes
// each row indexed by position, the layout SfiSelect reads (sfi_selector.cuh key_norms), and sums
// the squares of the bf16 keys in f32 (the twins agree to ~1e-6 relative on the same values).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct KeyNormsParams {
  const __nv_bfloat16* key_pool = nullptr;  // [blocks][num_kv_heads][block_tokens][head_dim]
  int64_t num_pool_blocks = 0;              // blocks in the pool, >= 1
  const int32_t* block_tables = nullptr;    // [batch][block_table_stride] physical block ids
  int block_table_stride = 0;
  const int32_t* begin = nullptr;  // [batch], device: first position (clamped to >= 0)
  const int32_t* count = nullptr;  // [batch], device: positions (clamped to [0, max_count])
  int max_count = 0;               // host bound of count, >= 0: fixes the grid
  int batch = 0;                   // >= 0; 0 is a no-op
  int num_kv_heads = 0;
  int head_dim = 0;      // a multiple of 8 (16-byte rows), <= 256
  int block_tokens = 0;  // >= 1
  // [batch][num_kv_heads][norms_stride] out: norms[(b * H + h) * norms_stride + p] = |K(b, h, p)|
  // for p in [begin[b], begin[b] + count[b]); a position at or past norms_stride is not written.
  // Other entries are left as they were.
  float* norms = nullptr;
  int64_t norms_stride = 0;  // >= 1
};

// Positions and block ids live on the device and are not checked here; a position past the
// block table or a block id outside [0, num_pool_blocks) (a caller bug) gives a NaN norm instead
// of a read out of bounds. The pool must be 16-byte aligned. Never synchronizes.
Status KeyNorms(const KeyNormsParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
