// Causal prefill attention on the GPU (prefill_attention.cuh): flash-attention style, bf16
// tensor cores (mma.sync m16n8k16, fp32 accumulation), online softmax in fp32. One block per
// (query tile of 64 (token, GQA head) rows, entry, KV head); key tiles of 64 double-buffered with
// cp.async, gathered from the paged pool per position (any block size).
// The loop and masks: docs/cuda_model.md "Prefill attention".
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/prefill_attention.cuh"

namespace rubato::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = kWarps * 16;  // query rows per thread block (16 per warp: one mma M)
constexpr int kKeyTile = 64;            // keys per key tile: whole blocks of 16 or 64 tokens
constexpr float kLog2e = 1.4426950408889634f;

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

// ---- PTX wrappers -------------------------------------------------------------------------

__device__ __forceinline__ uint32_t SharedAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16-byte asynchronous copy global -> shared; when !valid nothing is read and the 16 bytes are
// zero-filled (src-size 0), so padding rows and keys past the context are zeros, never stale
// data (0 x NaN in P V would poison the output).
__device__ __forceinline__ void CopyAsync16(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(shared)),
               "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i; register i gets
// row lane / 4, columns 2 (lane % 4) and +1 of matrix i (transposed: rows 2 (lane % 4) and +1
// of column lane / 4).
__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], const __nv_bfloat16* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(shared))
               : "memory");
}
__device__ __forceinline__ void LoadMatrixX4Transposed(uint32_t (&r)[4],
                                                       const __nv_bfloat16* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(shared))
               : "memory");
}

// d += a b for a 16x16 (row-major) bf16 A, a 16x8 (column-major) bf16 B, fp32 C/D. With
// g = lane / 4, c = 2 (lane % 4): a = {A[g][c..c+1], A[g+8][c..], A[g][c+8..], A[g+8][c+8..]},
// b = {B[c..c+1][g], B[c+8..c+9][g]}, d = {D[g][c], D[g][c+1], D[g+8][c], D[g+8][c+1]}.
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 -> one register of two bf16, `low` in the low half (the lower column of a fragment).
__device__ __forceinline__ uint32_t PackBf16x2(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// ---- the kernel ---------------------------------------------------------------------------

template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kThreads) PrefillAttentionKernel(const PrefillAttentionParams p) {
  using Layout = SharedLayout<kHeadDim>;
  constexpr int kStride = Layout::kStride;
  constexpr int kTileTokens = kTileRows / kGroup;  // query tokens per tile
  constexpr int kRowChunks = kHeadDim / 8;         // 16-byte chunks per head_dim row
  constexpr int kDimSteps = kHeadDim / 16;         // k-steps of Q K^T
  constexpr int kKeySteps = kKeyTile / 16;         // k-steps of P V
  constexpr int kKeyColumns = kKeyTile / 8;        // 8-key column tiles of S
  constexpr int kDimColumns = kHeadDim / 8;        // 8-wide column tiles of O

  const int entry = blockIdx.z;
  const int kv_head = blockIdx.y;
  // The last tiles of an entry see the most keys: schedule them first (blockIdx.x 0 runs first).
  const int tile = gridDim.x - 1 - blockIdx.x;
  const int entry_row0 = p.query_start[entry];
  const int entry_tokens = p.query_start[entry + 1] - entry_row0;
  const int tile_token0 = tile * kTileTokens;
  if (tile_token0 >= entry_tokens) return;  // uniform across the block: before any barrier
  const int tile_tokens = min(kTileTokens, entry_tokens - tile_token0);
  const int first_position = p.start_position[entry] + tile_token0;
  const int last_position = first_position + tile_tokens - 1;
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(entry) * p.block_table_stride;

  extern __shared__ __align__(16) unsigned char shared_raw[];
  __nv_bfloat16* q_shared = reinterpret_cast<__nv_bfloat16*>(shared_raw);
  __nv_bfloat16* k_shared = q_shared + Layout::kTileElements;
  __nv_bfloat16* v_shared = k_shared + 2 * Layout::kTileElements;

  // Key tiles some row attends: the union over the tile's rows of [0, SinkEnd(p)) and
  // [RecentBegin(p), p] is [0, SinkEnd(last)) and [RecentBegin(first), last] (both bounds grow
  // with p). Tile i < sink_tiles is tile i; the rest run from first_recent_tile to last_tile.
  // first_position - recent_tokens + 1 cannot overflow: positions >= 0, recent_tokens >= 1.
  const int sink_end = min(p.sink_tokens, last_position + 1);
  const int sink_tiles = (sink_end + kKeyTile - 1) / kKeyTile;
  const int recent_begin = max(p.sink_tokens, first_position - p.recent_tokens + 1);
  const int first_recent_tile = max(sink_tiles, recent_begin / kKeyTile);
  const int last_tile = last_position / kKeyTile;
  const int num_key_tiles = sink_tiles + max(0, last_tile - first_recent_tile + 1);
  const auto key_tile_at = [&](int i) {
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
  // One key tile into buffer `buffer`: 16-byte chunks, consecutive threads on consecutive
  // chunks of a key's row, and a block's rows of one KV head are contiguous in the pool.
  const auto load_key_tile = [&](int key_tile, int buffer) {
    const int key0 = key_tile * kKeyTile;
    for (int c = threadIdx.x; c < kKeyTile * kRowChunks; c += kThreads) {
      const int key = c / kRowChunks;
      const int column = (c % kRowChunks) * 8;
      const int position = key0 + key;
      const bool valid = position <= last_position;
      int64_t offset = 0;
      if (valid) {
        const int64_t block = block_table[position / p.block_tokens];
        const int64_t pool_row =
            (block * p.num_kv_heads + kv_head) * p.block_tokens + position % p.block_tokens;
        offset = pool_row * kHeadDim + column;
      }
      const int slot = (buffer * kKeyTile + key) * kStride + column;
      CopyAsync16(k_shared + slot, p.key_pool + offset, valid);
      CopyAsync16(v_shared + slot, p.value_pool + offset, valid);
    }
  };
  load_key_tile(key_tile_at(0), 0);  // num_key_tiles >= 1: the last row attends its own key
  CopyAsyncCommit();                 // group: Q tile + key tile 0

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int quad_row = lane / 4;         // this thread's rows: quad_row and quad_row + 8
  const int quad_column = lane % 4 * 2;  // and columns quad_column, +1 of each 8-column tile

  // Position and window start of this thread's two rows; padding rows act as the tile's last
  // token, so they stay finite like real rows.
  int row_position[2];
  int row_recent_begin[2];
  for (int half = 0; half < 2; ++half) {
    const int token = min((warp * 16 + quad_row + half * 8) / kGroup, tile_tokens - 1);
    row_position[half] = first_position + token;
    row_recent_begin[half] = max(p.sink_tokens, row_position[half] - p.recent_tokens + 1);
  }
  // Scores in log2 units: exp(scale s - m) = exp2(scale log2(e) s - m').
  const float scale_log2 = p.scale * kLog2e;

  uint32_t q_fragments[kDimSteps][4];  // A fragments of the warp's 16 query rows
  float o[kDimColumns][4];             // O accumulator, C fragments: [16 rows][head_dim]
  for (int j = 0; j < kDimColumns; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // running max (log2 units), quad-uniform
  float row_sum[2] = {0.f, 0.f};              // running sum of this thread's columns only

  for (int i = 0; i < num_key_tiles; ++i) {
    const int buffer = i & 1;
    if (i + 1 < num_key_tiles) {
      // The other buffer was released by the barrier at the end of iteration i - 1.
      load_key_tile(key_tile_at(i + 1), buffer ^ 1);
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

    // Scale, mask, and the tile's row max (over the quad: the 4 threads sharing a row).
    const int key0 = key_tile_at(i) * kKeyTile;
    const bool masked = tile_needs_mask(key0);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kKeyColumns; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e / 2;
        float score = s[j][e] * scale_log2;
        if (masked) {
          const int key = key0 + j * 8 + quad_column + e % 2;
          const bool attends =
              key <= row_position[half] && (key < p.sink_tokens || key >= row_recent_begin[half]);
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
#pragma unroll
    for (int j = 0; j < kDimColumns; ++j) {
      o[j][0] *= rescale[0];
      o[j][1] *= rescale[0];
      o[j][2] *= rescale[1];
      o[j][3] *= rescale[1];
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

    // O += P V. V is [key][dim] in shared = B row-major: transposed ldmatrix.
    // Matrices: keys 0-7 / 8-15 x dims 0-7 (b0, b1 of column tile j), dims 8-15 (tile j + 1).
    const __nv_bfloat16* values = v_shared + buffer * Layout::kTileElements;
#pragma unroll
    for (int k = 0; k < kKeySteps; ++k) {
#pragma unroll
      for (int j = 0; j < kDimColumns; j += 2) {
        uint32_t b[4];
        LoadMatrixX4Transposed(
            b, values + (k * 16 + lane % 8 + lane / 8 % 2 * 8) * kStride + j * 8 + lane / 16 * 8);
        MmaBf16(o[j], p_fragments[k], b[0], b[1]);
        MmaBf16(o[j + 1], p_fragments[k], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with `buffer` before iteration i + 1 refills it
  }

  // out = O / l. Every row attended at least its own key, so l >= 1 (the max term is exp2(0)).
  float inverse_sum[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
    inverse_sum[half] = 1.f / row_sum[half];
  }
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

// ---- launcher -----------------------------------------------------------------------------

Status ValidatePrefillAttention(const PrefillAttentionParams& params);

template <int kHeadDim, int kGroup>
Status LaunchPrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream) {
  constexpr int kTileTokens = kTileRows / kGroup;
  constexpr size_t kSharedBytes = SharedLayout<kHeadDim>::kBytes;  // 87 KiB at head_dim 128
  const auto kernel = PrefillAttentionKernel<kHeadDim, kGroup>;
  // Above 48 KiB of dynamic shared memory a kernel must opt in (per device, so every launch).
  if (kSharedBytes > 48 * 1024) {
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kSharedBytes)),
        "prefill_attention: allowing " + std::to_string(kSharedBytes) + " bytes of shared memory");
  }
  const dim3 grid((params.max_query_tokens + kTileTokens - 1) / kTileTokens, params.num_kv_heads,
                  params.entries);
  kernel<<<grid, kThreads, kSharedBytes, stream>>>(params);
  return LaunchStatus("prefill_attention");
}

}  // namespace

Status PrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidatePrefillAttention(params));
  if (params.entries == 0 || params.total_tokens == 0) return Status::Ok();
  const int group = params.num_heads / params.num_kv_heads;
  RUBATO_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, {
    RUBATO_DISPATCH_GQA_GROUP(group, kGroup,
                              { return LaunchPrefillAttention<kHeadDim, kGroup>(params, stream); });
  });
}

// ---- input validation ---------------------------------------------------------------------

namespace {

Status Invalid(const std::string& message) {
  return InvalidArgumentError("prefill_attention: " + message);
}

Status ValidatePrefillAttention(const PrefillAttentionParams& p) {
  // Shapes first (the grid's y and z dimensions hold at most 65535).
  if (p.entries < 0 || p.entries > 65535) {
    return Invalid("entries " + std::to_string(p.entries) + " is outside [0, 65535]");
  }
  if (p.total_tokens < 0) return Invalid("total_tokens " + std::to_string(p.total_tokens) + " < 0");
  if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_kv_heads > 65535) {
    return Invalid("num_heads " + std::to_string(p.num_heads) + " and num_kv_heads " +
                   std::to_string(p.num_kv_heads) + " must be positive (num_kv_heads <= 65535)");
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return Invalid("num_heads " + std::to_string(p.num_heads) +
                   " is not a multiple of num_kv_heads " + std::to_string(p.num_kv_heads));
  }
  if (p.head_dim <= 0 || p.head_dim % 8 != 0) {
    // Dispatch reports the unsupported values; this only keeps the stride checks meaningful.
    return UnsupportedError("CUDA: head_dim " + std::to_string(p.head_dim) +
                            " is not supported (supported: 16, 32, 64, 128)");
  }
  if (p.entries > 0 && p.total_tokens > 0 &&
      (p.max_query_tokens < 1 || p.max_query_tokens > p.total_tokens ||
       static_cast<int64_t>(p.max_query_tokens) * p.entries < p.total_tokens)) {
    return Invalid("max_query_tokens " + std::to_string(p.max_query_tokens) +
                   " cannot be the largest of " + std::to_string(p.entries) + " entries holding " +
                   std::to_string(p.total_tokens) + " tokens");
  }
  if (p.block_tokens <= 0) {
    return Invalid("block_tokens " + std::to_string(p.block_tokens) + " <= 0");
  }
  if (p.block_table_stride <= 0) {
    return Invalid("block_table_stride " + std::to_string(p.block_table_stride) + " <= 0");
  }
  const int64_t row_elements = static_cast<int64_t>(p.num_heads) * p.head_dim;
  if (p.q_row_stride < row_elements || p.q_row_stride % 8 != 0) {
    return Invalid(
        "q_row_stride " + std::to_string(p.q_row_stride) +
        " must be a multiple of 8 and >= num_heads * head_dim = " + std::to_string(row_elements));
  }
  if (p.out_row_stride < row_elements || p.out_row_stride % 8 != 0) {
    return Invalid(
        "out_row_stride " + std::to_string(p.out_row_stride) +
        " must be a multiple of 8 and >= num_heads * head_dim = " + std::to_string(row_elements));
  }
  if (!std::isfinite(p.scale)) return Invalid("scale is not finite");
  if (p.sink_tokens < 0) return Invalid("sink_tokens " + std::to_string(p.sink_tokens) + " < 0");
  if (p.recent_tokens < 1) {
    return Invalid("recent_tokens " + std::to_string(p.recent_tokens) + " < 1");
  }
  if (p.entries == 0 || p.total_tokens == 0) return Status::Ok();  // nothing will be read

  // Pointers: present, and 16-byte aligned where the kernel moves 16-byte chunks.
  const struct {
    const void* pointer;
    const char* name;
    bool chunked;
  } pointers[] = {{p.q, "q", true},
                  {p.key_pool, "key_pool", true},
                  {p.value_pool, "value_pool", true},
                  {p.out, "out", true},
                  {p.block_tables, "block_tables", false},
                  {p.query_start, "query_start", false},
                  {p.start_position, "start_position", false}};
  for (const auto& [pointer, name, chunked] : pointers) {
    if (pointer == nullptr) return Invalid(std::string(name) + " is null");
    if (chunked && !Aligned16(pointer)) {
      return Invalid(std::string(name) + " is not 16-byte aligned");
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
