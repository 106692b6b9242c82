// The prefill attention kernel template (prefill_attention.cuh), shared by the translation units
// that instantiate its modes (prefill_attention.cu: kDense; prefill_attention_{lse,pool,list}.cu:
// Kascade's), so that each unit compiles a bounded set. flash-attention style, bf16
// tensor cores (mma.sync m16n8k16, fp32 accumulation), online softmax in fp32. One block per
// (query tile of 64 (token, GQA head) rows, entry, KV head); key tiles of 64 double-buffered with
// cp.async, gathered from the paged pool per position. docs/cuda_model.md "Prefill attention".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/prefill_attention.cuh"

namespace rubato::cuda::prefill {

using namespace ::rubato::cuda::mma;  // NOLINT: the PTX wrappers read as plain calls below

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = kWarps * 16;  // query rows per thread block (16 per warp: one mma M)
constexpr int kKeyTile = 64;            // keys per key tile: whole blocks of 16 or 64 tokens
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared memory of one thread block. Rows are padded by 16 bytes so that the 8 row addresses
// of an ldmatrix fall into 8 different 4-bank groups (no bank conflicts, no swizzle needed).
template <int kHeadDim>
struct SharedLayout {
  static constexpr int kStride = kHeadDim + 8;  // bf16 elements per row
  static_assert(kTileRows == kKeyTile, "one tile size for Q, K and V");
  static constexpr int kTileElements = kTileRows * kStride;
  // q:      [kTileRows][kStride], bf16: the query tile, later the output tile
  // keys:   [2][kKeyTile][kStride], bf16: double-buffered key tiles
  // values: [2][kKeyTile][kStride], bf16: double-buffered value tiles
  static constexpr size_t kBytes = 5 * size_t{kTileElements} * sizeof(__nv_bfloat16);
};

template <int kHeadDim, int kGroup, PrefillMode kMode>
__global__ void __launch_bounds__(kThreads) PrefillAttentionKernel(const PrefillAttentionParams p) {
  using Layout = SharedLayout<kHeadDim>;
  constexpr int kStride = Layout::kStride;
  constexpr int kTileTokens = kTileRows / kGroup;  // query tokens per tile
  constexpr int kRowChunks = kHeadDim / 8;         // 16-byte chunks per head_dim row
  constexpr int kDimSteps = kHeadDim / 16;         // k-steps of Q K^T
  constexpr int kKeySteps = kKeyTile / 16;         // k-steps of P V
  constexpr int kKeyColumns = kKeyTile / 8;        // 8-key column tiles of S
  constexpr int kDimColumns = kHeadDim / 8;        // 8-wide column tiles of O
  constexpr bool kValues = kMode == PrefillMode::kDense || kMode == PrefillMode::kList;
  constexpr bool kSelectionTiles = kMode != PrefillMode::kDense;

  const int entry = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int entry_row0 = p.query_start[entry];
  const int entry_tokens = p.query_start[entry + 1] - entry_row0;
  const int entry_start = p.start_position[entry];
  // Query tiles are aligned to absolute positions (multiples of kTileTokens, which divides 64),
  // so a block never straddles a selection tile. The last tiles of an entry see the most keys:
  // schedule them first (blockIdx.x 0 runs first).
  const int tile = gridDim.x - 1 - blockIdx.x;
  const int aligned_start = entry_start / kTileTokens * kTileTokens;
  const int first_position = max(entry_start, aligned_start + tile * kTileTokens);
  const int end_position =
      min(entry_start + entry_tokens, aligned_start + (tile + 1) * kTileTokens);
  if (first_position >= end_position) return;  // uniform across the block: before any barrier
  const int tile_token0 = first_position - entry_start;
  const int tile_tokens = end_position - first_position;
  const int last_position = end_position - 1;
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(entry) * p.block_table_stride;

  // The selection tile of this block's rows, and its index in the tile arrays (-1: none).
  [[maybe_unused]] int selection = -1;
  [[maybe_unused]] int selection_begin = 0;
  if constexpr (kSelectionTiles) {
    const int base = p.tile_base[entry];
    selection_begin = first_position / p.tile_tokens * p.tile_tokens;
    if (base >= 0) selection = base + first_position / p.tile_tokens - entry_start / p.tile_tokens;
    if (selection < 0 && kMode != PrefillMode::kList) return;  // kLse, kPool: not selecting
  }
  // kList: the tile's list of earlier positions (list_count 0 for an entry attended densely).
  [[maybe_unused]] const int32_t* list = nullptr;
  [[maybe_unused]] int list_count = 0;
  if constexpr (kMode == PrefillMode::kList) {
    if (selection >= 0) {
      const int m = p.head_map != nullptr ? p.head_map[kv_head] : kv_head;
      const int64_t at = static_cast<int64_t>(selection) * p.list_heads + m;
      list = p.lists + at * p.list_capacity;
      list_count = min(max(p.list_counts[at], 0), p.list_capacity);
    }
  }

  extern __shared__ __align__(16) unsigned char shared_raw[];
  __nv_bfloat16* q_shared = reinterpret_cast<__nv_bfloat16*>(shared_raw);
  __nv_bfloat16* k_shared = q_shared + Layout::kTileElements;
  __nv_bfloat16* v_shared = k_shared + 2 * Layout::kTileElements;

  // Key tiles. kDense / kLse: those some row attends: the union over the tile's rows of
  // [0, SinkEnd(p)) and [RecentBegin(p), p] is [0, SinkEnd(last)) and [RecentBegin(first), last]
  // (both bounds grow with p). Tile i < sink_tiles is tile i; the rest run from
  // first_recent_tile to last_tile. kPool: the tiles before the selection tile. kList: the
  // list's tiles (list_tiles of them), then the selection tile's own tiles up to the last row
  // (from 0 for an entry attended densely). first_position - recent_tokens + 1 cannot overflow:
  // positions >= 0, recent_tokens >= 1.
  const int sink_end = min(p.sink_tokens, last_position + 1);
  const int sink_tiles = (sink_end + kKeyTile - 1) / kKeyTile;
  const int recent_begin = max(p.sink_tokens, first_position - p.recent_tokens + 1);
  const int first_recent_tile = max(sink_tiles, recent_begin / kKeyTile);
  const int last_tile = last_position / kKeyTile;
  int num_key_tiles = sink_tiles + max(0, last_tile - first_recent_tile + 1);
  [[maybe_unused]] int list_tiles = 0;
  [[maybe_unused]] int own_first_tile = 0;
  if constexpr (kMode == PrefillMode::kPool) {
    num_key_tiles = selection_begin / kKeyTile;
    if (num_key_tiles == 0) return;  // the first tile has nothing before it
  } else if constexpr (kMode == PrefillMode::kList) {
    list_tiles = (list_count + kKeyTile - 1) / kKeyTile;
    own_first_tile = selection >= 0 ? selection_begin / kKeyTile : 0;
    num_key_tiles = list_tiles + last_tile - own_first_tile + 1;
  }
  // Key tile i's index in key tiles of 64 positions (-1: a tile of the list).
  const auto key_tile_at = [&](int i) {
    if constexpr (kMode == PrefillMode::kPool) return i;
    if constexpr (kMode == PrefillMode::kList) {
      return i < list_tiles ? -1 : own_first_tile + i - list_tiles;
    }
    return i < sink_tiles ? i : first_recent_tile + (i - sink_tiles);
  };
  // Every key of a tile is attended by every row when it is causal for the first row and inside
  // the window of the last row (the window's recent segment only shrinks from the left).
  const int last_recent_begin = max(p.sink_tokens, last_position - p.recent_tokens + 1);
  const auto tile_needs_mask = [&](int key0) {
    const bool causal_for_all = key0 + kKeyTile - 1 <= first_position;
    const bool in_window_for_all = key0 + kKeyTile <= p.sink_tokens || key0 >= last_recent_begin;
    return !(causal_for_all && in_window_for_all);
  };

  // Q tile: rows past the entry's tokens are zero-filled (computed, never stored).
  for (int c = threadIdx.x; c < kTileRows * kRowChunks; c += kThreads) {
    const int row = c / kRowChunks;
    const int column = (c % kRowChunks) * 8;
    const int token = row / kGroup;
    const bool valid = token < tile_tokens;
    const __nv_bfloat16* source =
        valid ? p.q + static_cast<int64_t>(entry_row0 + tile_token0 + token) * p.q_row_stride +
                    (kv_head * kGroup + row % kGroup) * kHeadDim + column
              : p.q;
    CopyAsync16(q_shared + row * kStride + column, source, valid);
  }
  // Key tile i into buffer `buffer`: 16-byte chunks, consecutive threads on consecutive chunks
  // of a key's row. Positions outside the tile's keys are zero-filled, never read.
  const auto load_key_tile = [&](int i, int buffer) {
    const int key0 = key_tile_at(i) * kKeyTile;
    for (int c = threadIdx.x; c < kKeyTile * kRowChunks; c += kThreads) {
      const int key = c / kRowChunks;
      const int column = (c % kRowChunks) * 8;
      int position = key0 + key;
      bool valid = position <= last_position;
      if constexpr (kMode == PrefillMode::kList) {
        if (i < list_tiles) {
          const int j = i * kKeyTile + key;
          position = j < list_count ? list[j] : -1;
          valid = position >= 0 && position < selection_begin;
        }
      }
      int64_t offset = 0;
      if (valid) {
        const int64_t block = block_table[position / p.block_tokens];
        const int64_t pool_row =
            (block * p.num_kv_heads + kv_head) * p.block_tokens + position % p.block_tokens;
        offset = pool_row * kHeadDim + column;
      }
      const int slot = (buffer * kKeyTile + key) * kStride + column;
      CopyAsync16(k_shared + slot, p.key_pool + offset, valid);
      if constexpr (kValues) CopyAsync16(v_shared + slot, p.value_pool + offset, valid);
    }
  };
  load_key_tile(0, 0);  // num_key_tiles >= 1: the last row attends its own key
  CopyAsyncCommit();    // group: Q tile + key tile 0

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;         // this thread's rows: quad_row and quad_row + 8
  const int quad_column = lane % 4 * 2;  // and columns quad_column, +1 of each 8-column tile

  // Position and window start of this thread's two rows; padding rows act as the tile's last
  // token, so they stay finite like real rows.
  int row_position[2];
  int row_recent_begin[2];
  bool row_valid[2];
  int64_t row_lse_index[2];  // into lse: [row][num_heads]
  for (int half = 0; half < 2; ++half) {
    const int tile_row = warp * 16 + quad_row + half * 8;
    row_valid[half] = tile_row / kGroup < tile_tokens;
    const int token = min(tile_row / kGroup, tile_tokens - 1);
    row_position[half] = first_position + token;
    row_recent_begin[half] = max(p.sink_tokens, row_position[half] - p.recent_tokens + 1);
    row_lse_index[half] = static_cast<int64_t>(entry_row0 + tile_token0 + token) * p.num_heads +
                          kv_head * kGroup + tile_row % kGroup;
  }
  // Scores in log2 units: exp(scale s - m) = exp2(scale log2(e) s - m').
  const float scale_log2 = p.scale * kLog2e;
  [[maybe_unused]] float row_lse2[2] = {0.f, 0.f};  // kPool: each row's lse in log2 units
  if constexpr (kMode == PrefillMode::kPool) {
    for (int half = 0; half < 2; ++half) row_lse2[half] = p.lse[row_lse_index[half]] * kLog2e;
  }

  uint32_t q_fragments[kDimSteps][4];  // A fragments of the warp's 16 query rows
  float o[kDimColumns][4];             // O accumulator, C fragments: [16 rows][head_dim]
  for (int j = 0; j < kDimColumns; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // running max (log2 units), quad-uniform
  float row_sum[2] = {0.f, 0.f};              // running sum of this thread's columns only

  for (int i = 0; i < num_key_tiles; ++i) {
    const int buffer = i & 1;
    if (i + 1 < num_key_tiles) {
      // The other buffer was released by the barrier at the end of iteration i - 1.
      load_key_tile(i + 1, buffer ^ 1);
      CopyAsyncCommit();
      CopyAsyncWait<1>();  // everything but the tile just issued has landed
    } else {
      CopyAsyncWait<0>();
    }
    __syncthreads();  // tile i (and at i == 0 the Q tile) visible to every warp

    if (i == 0) {
      // Matrices: rows 0-7 / 8-15 x columns 0-7 / 8-15 of the k-step = a0, a1, a2, a3.
      const __nv_bfloat16* q_rows = q_shared + (warp * 16 + lane % 16) * kStride + lane / 16 * 8;
#pragma unroll
      for (int k = 0; k < kDimSteps; ++k) LoadMatrixX4(q_fragments[k], q_rows + k * 16);
    }

    // S = Q K^T. K is [key][dim] in shared = B^T, i.e. B column-major: plain ldmatrix.
    // Matrices: keys 0-7 x dims 0-7 / 8-15 (b0, b1 of column tile j), keys 8-15 (tile j + 1).
    const __nv_bfloat16* keys = k_shared + buffer * Layout::kTileElements;
    float s[kKeyColumns][4];
#pragma unroll
    for (int j = 0; j < kKeyColumns; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int k = 0; k < kDimSteps; ++k) {
#pragma unroll
      for (int j = 0; j < kKeyColumns; j += 2) {
        uint32_t b[4];
        LoadMatrixX4(
            b, keys + (j * 8 + lane % 8 + lane / 16 * 8) * kStride + k * 16 + lane / 8 % 2 * 8);
        MmaBf16(s[j], q_fragments[k], b[0], b[1]);
        MmaBf16(s[j + 1], q_fragments[k], b[2], b[3]);
      }
    }

    if constexpr (kMode == PrefillMode::kPool) {
      // Every key here precedes every row (no mask): each row's probability exp2(s - lse2),
      // summed over the warp's valid rows per key column, then over the warps, then added to the
      // tile's pooled row (the other blocks of the tile add theirs).
      __shared__ float column_sums[kWarps][kKeyTile];
#pragma unroll
      for (int j = 0; j < kKeyColumns; ++j) {
        float sum[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float top = row_valid[0] ? exp2f(s[j][c] * scale_log2 - row_lse2[0]) : 0.f;
          const float bottom = row_valid[1] ? exp2f(s[j][2 + c] * scale_log2 - row_lse2[1]) : 0.f;
          sum[c] = top + bottom;
          sum[c] += __shfl_xor_sync(0xffffffffu, sum[c], 4);
          sum[c] += __shfl_xor_sync(0xffffffffu, sum[c], 8);
          sum[c] += __shfl_xor_sync(0xffffffffu, sum[c], 16);
        }
        if (quad_row == 0) {
          column_sums[warp][j * 8 + quad_column] = sum[0];
          column_sums[warp][j * 8 + quad_column + 1] = sum[1];
        }
      }
      __syncthreads();
      if (threadIdx.x < kKeyTile) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) total += column_sums[w][threadIdx.x];
        const int64_t at =
            (static_cast<int64_t>(selection) * p.num_kv_heads + kv_head) * p.pooled_stride +
            i * kKeyTile + threadIdx.x;
        if (total != 0.f) atomicAdd(p.pooled + at, total);
      }
    } else {
      // Scale, mask, and the tile's row max (over the quad: the 4 threads sharing a row).
      const int key0 = key_tile_at(i) * kKeyTile;
      bool masked = tile_needs_mask(key0);
      if constexpr (kMode == PrefillMode::kList) {
        if (i < list_tiles) masked = (i + 1) * kKeyTile > list_count;  // a partial last list tile
      }
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kKeyColumns; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e / 2;
          float score = s[j][e] * scale_log2;
          if (masked) {
            const int column = j * 8 + quad_column + e % 2;
            bool attends;
            if (kMode == PrefillMode::kList && i < list_tiles) {
              attends = i * kKeyTile + column < list_count;
            } else {
              const int key = key0 + column;
              attends = key <= row_position[half] &&
                        (key < p.sink_tokens || key >= row_recent_begin[half]);
            }
            if (!attends) score = -INFINITY;
          }
          s[j][e] = score;
          tile_max[half] = fmaxf(tile_max[half], score);
        }
      }
      float rescale[2];
      float subtract[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
        tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
        const float new_max = fmaxf(row_max[half], tile_max[half]);
        // A row that has attended nothing yet keeps max -inf; subtracting 0 then gives
        // exp2(-inf) = 0 for its masked scores instead of exp2(-inf + inf) = NaN.
        subtract[half] = new_max == -INFINITY ? 0.f : new_max;
        rescale[half] = exp2f(row_max[half] - subtract[half]);  // 0 while row_max is -inf
        row_max[half] = new_max;
        row_sum[half] *= rescale[half];
      }
      if constexpr (kValues) {
#pragma unroll
        for (int j = 0; j < kDimColumns; ++j) {
          o[j][0] *= rescale[0];
          o[j][1] *= rescale[0];
          o[j][2] *= rescale[1];
          o[j][3] *= rescale[1];
        }
      }

      // P = exp2(S - m) in fp32 for the sums, bf16 as the A operand of P V: the C fragments of
      // key columns 2k and 2k + 1 are exactly the A fragment of key step k.
      uint32_t p_fragments[kKeySteps][4];
#pragma unroll
      for (int j = 0; j < kKeyColumns; ++j) {
        const float p0 = exp2f(s[j][0] - subtract[0]);
        const float p1 = exp2f(s[j][1] - subtract[0]);
        const float p2 = exp2f(s[j][2] - subtract[1]);
        const float p3 = exp2f(s[j][3] - subtract[1]);
        row_sum[0] += p0 + p1;
        row_sum[1] += p2 + p3;
        p_fragments[j / 2][j % 2 * 2] = PackBf16x2(p0, p1);      // a0 / a2: row quad_row
        p_fragments[j / 2][j % 2 * 2 + 1] = PackBf16x2(p2, p3);  // a1 / a3: row quad_row + 8
      }

      if constexpr (kValues) {
        // O += P V. V is [key][dim] in shared = B row-major: transposed ldmatrix.
        // Matrices: keys 0-7 / 8-15 x dims 0-7 (b0, b1 of column tile j), dims 8-15 (j + 1).
        const __nv_bfloat16* values = v_shared + buffer * Layout::kTileElements;
#pragma unroll
        for (int k = 0; k < kKeySteps; ++k) {
#pragma unroll
          for (int j = 0; j < kDimColumns; j += 2) {
            uint32_t b[4];
            LoadMatrixX4Transposed(b, values + (k * 16 + lane % 8 + lane / 8 % 2 * 8) * kStride +
                                          j * 8 + lane / 16 * 8);
            MmaBf16(o[j], p_fragments[k], b[0], b[1]);
            MmaBf16(o[j + 1], p_fragments[k], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with `buffer` (kPool: column_sums) before i + 1
  }
  // out = O / l. Every row attended at least its own key, so l >= 1 (the max term is exp2(0)).
  [[maybe_unused]] float inverse_sum[2] = {0.f, 0.f};
  if constexpr (kMode != PrefillMode::kPool) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
      row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
      inverse_sum[half] = 1.f / row_sum[half];
      // lse = (m + log2 l) ln 2, natural log, one lane of the quad writes it.
      const bool write_lse =
          kMode == PrefillMode::kLse || (kMode == PrefillMode::kDense && p.lse != nullptr);
      if (write_lse && lane % 4 == 0 && row_valid[half]) {
        p.lse[row_lse_index[half]] = (row_max[half] + log2f(row_sum[half])) * kLn2;
      }
    }
  }
  if constexpr (kValues) {
    // Stage the warp's 16 output rows in its own 16 Q rows (only this warp ever read them, into
    // registers at i == 0), then store 16-byte chunks: the kGroup rows of a token are one
    // contiguous run of heads in the output row.
    __nv_bfloat16* out_rows = q_shared + warp * 16 * kStride;
#pragma unroll
    for (int j = 0; j < kDimColumns; ++j) {
      const int column = j * 8 + quad_column;
      *reinterpret_cast<__nv_bfloat162*>(out_rows + quad_row * kStride + column) =
          __floats2bfloat162_rn(o[j][0] * inverse_sum[0], o[j][1] * inverse_sum[0]);
      *reinterpret_cast<__nv_bfloat162*>(out_rows + (quad_row + 8) * kStride + column) =
          __floats2bfloat162_rn(o[j][2] * inverse_sum[1], o[j][3] * inverse_sum[1]);
    }
    __syncwarp();
    for (int c = lane; c < 16 * kRowChunks; c += 32) {
      const int row = c / kRowChunks;
      const int column = (c % kRowChunks) * 8;
      const int tile_row = warp * 16 + row;
      const int token = tile_row / kGroup;
      if (token >= tile_tokens) continue;
      __nv_bfloat16* destination =
          p.out + static_cast<int64_t>(entry_row0 + tile_token0 + token) * p.out_row_stride +
          (kv_head * kGroup + tile_row % kGroup) * kHeadDim + column;
      *reinterpret_cast<uint4*>(destination) =
          *reinterpret_cast<const uint4*>(out_rows + row * kStride + column);
    }
  }
}

// The launch of one mode for the params' head_dim and GQA group (validated by the caller).
template <PrefillMode kMode>
Status LaunchPrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream) {
  const int group = params.num_heads / params.num_kv_heads;
  RUBATO_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, {
    RUBATO_DISPATCH_GQA_GROUP(group, kGroup, {
      constexpr int kTileTokens = kTileRows / kGroup;
      constexpr size_t kSharedBytes = SharedLayout<kHeadDim>::kBytes;  // 87 KiB at head_dim 128
      const auto kernel = PrefillAttentionKernel<kHeadDim, kGroup, kMode>;
      // Above 48 KiB of dynamic shared memory a kernel must opt in (per device, every launch).
      if (kSharedBytes > 48 * 1024) {
        RUBATO_CUDA_RETURN_IF_ERROR(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(kSharedBytes)),
            "prefill_attention: allowing " + std::to_string(kSharedBytes) +
                " bytes of shared memory");
      }
      // Absolute query tiles: an entry starting mid-tile meets one tile more than its length.
      const dim3 grid((params.max_query_tokens + 2 * kTileTokens - 2) / kTileTokens,
                      params.num_kv_heads, params.entries);
      kernel<<<grid, kThreads, kSharedBytes, stream>>>(params);
      return LaunchStatus("prefill_attention");
    });
  });
}

// The Kascade modes, one translation unit each (prefill_attention_{lse,pool,list}.cu).
Status LaunchPrefillLse(const PrefillAttentionParams& params, cudaStream_t stream);
Status LaunchPrefillPool(const PrefillAttentionParams& params, cudaStream_t stream);
Status LaunchPrefillList(const PrefillAttentionParams& params, cudaStream_t stream);

}  // namespace rubato::cuda::prefill
