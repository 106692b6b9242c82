// Host-side encoding of the tensor maps the copy engine reads tiles through (async_copy.cuh):
// a 2D view of a bf16 array as rows x columns, copied in boxes with the 128-byte swizzle.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct Bf16RowsMapShape {
  int64_t rows = 0;         // < 2^31: tile coordinates are 32-bit
  int row_elements = 0;     // contiguous bf16 per row (the row pitch), a multiple of 8
  int box_columns = 0;      // elements per box row: 128 bytes (64) for the 128-byte swizzle
  int box_rows = 0;         // 1 .. 256
};

// Encodes `map` over `base` (16-byte aligned). Boxes land in shared memory in the 128-byte
// swizzle: 16-byte chunk c of box row r at chunk c ^ (r % 8) of a 128-byte row. L2 promotion is
// 128 bytes: with 256 the L2 read 25 % more sectors and decode attention ran 1 % slower, with
// 128 its L2 requests matched a plain coalesced kernel's (ncu on an H200,
// bench/results/decode_attention_notes.md). Errors name the driver's result code.
Status EncodeBf16RowsMap(const __nv_bfloat16* base, const Bf16RowsMapShape& shape,
                         CUtensorMap& map);

}  // namespace rubato::cuda
