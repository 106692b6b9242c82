// Key norms (key_norms.cuh): kernel, launcher, validation. A key row of head_dim bf16 is read by
// a segment of `lanes` = head_dim / 8 lanes rounded up to a power of two (16 bytes each; 16 lanes
// at head_dim 128, so a warp reads two rows per load), squared and summed in f32, and a butterfly
// reduction within the segment gives the row's sum. Each warp takes kRowsPerLane loads per lane
// (rows spaced a warp-load apart) before reducing, so that every lane has several loads in
// flight; a block covers kWarps x that many consecutive positions of one (sequence, KV head).
// Loads are issued unconditionally (clamped, masked after) and positions use 32-bit math. H200,
// 16 x 32K x 8 KV heads x 128 dims (1.07 GB): 0.42 ms, ~2.5 TB/s, still latency-bound (the key-
// norm prior's cost: docs/sfi.md); one warp per position was launch-bound at ~1 ms.
#include <cuda_bf16.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/key_norms.cuh"
#include "kernels/cuda/launch_checks.h"

namespace rubato::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerLane = 8;  // loads in flight per lane
// Blocks per SM the registers must allow (64 per thread): H200, 16 x 32K, 0.42 ms at 4 against
// 0.61 ms with the compiler's choice (82 registers, 3 blocks); 16 rows per lane at 2 blocks
// 0.71 ms, 4 rows at 4 blocks 0.47 ms.
constexpr int kMinBlocksPerSm = 4;
constexpr int kMaxGridY = 65535;
constexpr int kMaxHeadDim = 256;  // 32 lanes x 8 dims

// Lanes per key row: head_dim / 8 rounded up to a power of two (<= 32).
int LanesPerRow(int head_dim) {
  return static_cast<int>(std::bit_ceil(static_cast<unsigned>(head_dim / 8)));
}

// ---- kernel -----------------------------------------------------------------------------------

// grid.x covers max_count positions, kWarps x (32 / lanes) x kRowsPerLane per block; grid.y
// strides over the batch * num_kv_heads (sequence, KV head) pairs. lanes: LanesPerRow(head_dim).
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    KeyNormsKernel(const KeyNormsParams p, int lanes) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int rows_per_load = 32 / lanes;   // rows a warp reads per load
  const int segment_lane = lane % lanes;  // this lane's 16 bytes of its row
  const int column = segment_lane * 8;
  const int warp_rows = rows_per_load * kRowsPerLane;  // positions per warp
  const int first = (static_cast<int>(blockIdx.x) * kWarps + warp) * warp_rows + lane / lanes;
  const int64_t pairs = static_cast<int64_t>(p.batch) * p.num_kv_heads;
  for (int64_t pair = blockIdx.y; pair < pairs; pair += gridDim.y) {
    const int sequence = static_cast<int>(pair / p.num_kv_heads);
    const int kv_head = static_cast<int>(pair % p.num_kv_heads);
    const int count = min(max(p.count[sequence], 0), p.max_count);
    if (first - lane / lanes >= count) continue;  // the warp's first row: warp-uniform
    const int begin = max(p.begin[sequence], 0);
    const int32_t* table = p.block_tables + sequence * static_cast<int64_t>(p.block_table_stride);
    const int64_t table_positions = static_cast<int64_t>(p.block_table_stride) * p.block_tokens;
    // Every lane loads all its rows unconditionally (a row without a valid block reads block
    // 0, masked below): a load behind a branch on the block id would wait for the table read
    // of each row in turn.
    uint4 packed[kRowsPerLane];
    bool valid[kRowsPerLane];
    const int safe_column = min(column, p.head_dim - 8);
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) {
      // 32-bit division (a 64-bit one is a software routine per row): positions past the
      // table (< 2^31, Validate) are clamped to its end and masked.
      const int index = first + r * rows_per_load;
      const int64_t wide_position = static_cast<int64_t>(begin) + index;
      const int position = static_cast<int>(min(wide_position, table_positions - 1));
      const int table_index = position / p.block_tokens;
      const int row = position - table_index * p.block_tokens;
      const int block = table[table_index];
      valid[r] = index < count && wide_position < table_positions && block >= 0 &&
                 block < p.num_pool_blocks;
      // [blocks][num_kv_heads][block_tokens][head_dim]
      const int64_t source =
          ((static_cast<int64_t>(valid[r] ? block : 0) * p.num_kv_heads + kv_head) *
               p.block_tokens +
           row) *
              p.head_dim +
          safe_column;
      packed[r] = *reinterpret_cast<const uint4*>(p.key_pool + source);
    }
    float squares[kRowsPerLane];
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) {
      squares[r] = 0.f;
      if (column < p.head_dim) {
        const __nv_bfloat162* halves = reinterpret_cast<const __nv_bfloat162*>(&packed[r]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 v = __bfloat1622float2(halves[k]);
          squares[r] = fmaf(v.x, v.x, squares[r]);
          squares[r] = fmaf(v.y, v.y, squares[r]);
        }
      }
      if (!valid[r]) squares[r] = __int_as_float(0x7fffffff);  // NaN: shows a caller bug
    }
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) {
      for (int offset = lanes / 2; offset > 0; offset /= 2) {
        squares[r] += __shfl_xor_sync(0xffffffffu, squares[r], offset);
      }
      const int index = first + r * rows_per_load;
      const int64_t position = static_cast<int64_t>(begin) + index;
      if (segment_lane == 0 && index < count && position < p.norms_stride) {
        p.norms[pair * p.norms_stride + position] = sqrtf(squares[r]);
      }
    }
  }
}

Status Validate(const KeyNormsParams& p);

}  // namespace

// ---- launcher ---------------------------------------------------------------------------------

Status KeyNorms(const KeyNormsParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.batch == 0 || params.max_count == 0) return Status::Ok();
  const int lanes = LanesPerRow(params.head_dim);
  const int64_t positions_per_block = static_cast<int64_t>(kWarps) * (32 / lanes) * kRowsPerLane;
  const int64_t pairs = static_cast<int64_t>(params.batch) * params.num_kv_heads;
  const dim3 grid(
      static_cast<unsigned>((params.max_count + positions_per_block - 1) / positions_per_block),
      static_cast<unsigned>(std::min<int64_t>(pairs, kMaxGridY)));
  KeyNormsKernel<<<grid, kThreads, 0, stream>>>(params, lanes);
  return LaunchStatus("key_norms");
}

// ---- validation -------------------------------------------------------------------------------

namespace {

Status Validate(const KeyNormsParams& p) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("KeyNorms: " + what);
  };
  if (p.batch < 0) return invalid("batch = " + std::to_string(p.batch) + " must be >= 0");
  if (p.max_count < 0) {
    return invalid("max_count = " + std::to_string(p.max_count) + " must be >= 0");
  }
  if (p.num_kv_heads < 1) {
    return invalid("num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be >= 1");
  }
  if (p.head_dim < 8 || p.head_dim % 8 != 0 || p.head_dim > kMaxHeadDim) {
    return invalid("head_dim = " + std::to_string(p.head_dim) +
                   " must be a multiple of 8 (16-byte rows) in [8, 256]");
  }
  if (p.block_tokens < 1) {
    return invalid("block_tokens = " + std::to_string(p.block_tokens) + " must be >= 1");
  }
  if (p.num_pool_blocks < 1) {
    return invalid("num_pool_blocks = " + std::to_string(p.num_pool_blocks) + " must be >= 1");
  }
  if (p.block_table_stride < 1) {
    return invalid("block_table_stride = " + std::to_string(p.block_table_stride) +
                   " must be >= 1");
  }
  if (static_cast<int64_t>(p.block_table_stride) * p.block_tokens > INT_MAX) {
    return invalid("block_table_stride x block_tokens = " +
                   std::to_string(static_cast<int64_t>(p.block_table_stride) * p.block_tokens) +
                   " positions exceed 2^31 - 1");
  }
  if (p.norms_stride < 1) {
    return invalid("norms_stride = " + std::to_string(p.norms_stride) + " must be >= 1");
  }
  if (p.batch == 0 || p.max_count == 0) return Status::Ok();  // nothing is read or written
  if (p.key_pool == nullptr) return invalid("key_pool is null");
  if (!Aligned16(p.key_pool)) return invalid("key_pool must be 16-byte aligned");
  if (p.block_tables == nullptr) return invalid("block_tables is null");
  if (p.begin == nullptr) return invalid("begin is null");
  if (p.count == nullptr) return invalid("count is null");
  if (p.norms == nullptr) return invalid("norms is null");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
