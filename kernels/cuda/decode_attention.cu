// Dense decode attention (decode_attention.cuh): split-K flash-decoding over a paged bf16 KV
// cache, GQA-aware, on tensor cores.
//
// Work split. One thread block per (split, KV head, sequence). It owns a contiguous range of the
// sequence's attended keys ("visible" keys: the sink segment then the recent segment, numbered
// 0..count-1) and computes, for the GQA group's query heads, a partial softmax over that range.
// A second kernel merges the splits by their log-sum-exp. Every K/V byte is read once per step
// and shared by the whole GQA group, so the kernel is bound by HBM bandwidth: the design goal is
// to keep enough bytes in flight (kStages tiles per block, two blocks per SM, each tile moved
// by bulk copies of whole padded K / V rows that complete on a per-stage mbarrier).
//
// Tile math. The group's G <= 8 query rows are the M = 16 rows of an m16n8k16 bf16 MMA (rows G..15
// are zero): S = Q K^T takes K straight from shared memory (a key row is the MMA's column-major B
// operand), P V takes V through ldmatrix.trans. Wasting up to 15/16 of the tensor-core rows costs
// nothing here: the tensor cores are idle >95% of the time either way, and the alternative
// (CUDA-core dot products with shuffle reductions) would compete with the loads for issue slots.
// Each of the 4 warps takes 16 keys of every 64-key tile and keeps its own running max / sum /
// output (FlashAttention-2 style); the warps are merged once at the end of the block's range.
//
// Scores are kept in log2 units (scale * log2(e) folded in) so that exp2f is the only
// transcendental; log-sum-exp is converted back to natural log on output.
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch_checks.h"

namespace rubato::cuda {
namespace {

#ifndef RUBATO_DECODE_TILE_KEYS  // build-time knobs for benchmark sweeps only
#define RUBATO_DECODE_TILE_KEYS 64
#define RUBATO_DECODE_STAGES 3
#define RUBATO_DECODE_BLOCKS_PER_SM 2
#endif
#ifndef RUBATO_DECODE_ROW_PAD_BYTES  // build-time knob for benchmark sweeps only
#define RUBATO_DECODE_ROW_PAD_BYTES 32
#endif
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = RUBATO_DECODE_TILE_KEYS;  // keys per pipeline stage
constexpr int kKeysPerWarp = kTileKeys / kWarps;    // a multiple of 16 (P V k-steps)
constexpr int kKeySteps = kKeysPerWarp / 16;        // P V k-steps per warp and tile
constexpr int kScoreBlocks = kKeysPerWarp / 8;      // S n-blocks per warp and tile
constexpr int kStages = RUBATO_DECODE_STAGES;       // tiles in flight per block
static_assert(kKeysPerWarp % 16 == 0, "warps take whole P V k-steps");
constexpr int kMinKeysPerSplit = 256;  // bounds the split count (and the workspace)
constexpr int kBlocksPerSm = RUBATO_DECODE_BLOCKS_PER_SM;  // what the shared memory allows
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared-memory layout of one stage: a K tile then a V tile, each [kTileKeys][row], where a row
// is head_dim bf16 plus 32 bytes of padding. The padding trades shared-memory bank conflicts
// against L2 traffic: the copy engine splits a bulk copy where its destination crosses a
// 128-byte boundary, and a source sector that straddles such a split is read from L2 twice. With
// rows 32-byte aligned no sector straddles; with 16 bytes of padding (conflict-free reads) half
// the rows did, costing 11 % more L2 sector reads and 47 % more L2 requests, and 1.5 % of the
// time at 16 x 128K (ncu and timings on an H200, bench/results/decode_attention_notes.md). The
// price is a 2-way bank conflict on the ldmatrix row reads of V (rows r and r + 4 of 8 share
// banks; shared-memory pipes are ~15 % busy); K's reads stay conflict-free (see Q's fragments).
template <int kHeadDim>
struct TileLayout {
  static constexpr int kRowBytes = kHeadDim * 2 + RUBATO_DECODE_ROW_PAD_BYTES;
  static constexpr int kTileBytes = kTileKeys * kRowBytes;
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};

// The keys the query at position L - 1 attends, numbered 0..count-1: the sink segment
// [0, sink_end) then the recent segment [recent_begin, L) (kernels/cpu/attention_window.h).
struct VisibleKeys {
  int sink_end;
  int recent_begin;
  int count;
  __device__ int Position(int index) const {
    return index < sink_end ? index : recent_begin + (index - sink_end);
  }
};

__device__ inline VisibleKeys VisibleKeysOf(int seq_len, int sink_tokens, int recent_tokens) {
  VisibleKeys keys;
  if (seq_len <= 0) return VisibleKeys{0, 0, 0};
  const int position = seq_len - 1;
  keys.sink_end = min(sink_tokens, seq_len);
  // position - recent + 1 >= -INT_MAX + 1: no overflow for recent_tokens <= INT_MAX.
  keys.recent_begin = max(sink_tokens, position - recent_tokens + 1);
  keys.count = keys.sink_end + max(0, seq_len - keys.recent_begin);
  return keys;
}

// ---- PTX wrappers ---------------------------------------------------------------------------

__device__ inline unsigned SharedAddress(const void* smem) {
  return static_cast<unsigned>(__cvta_generic_to_shared(smem));
}
__device__ inline void MbarrierInit(uint64_t* barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(barrier)),
               "r"(arrivals));
}
// Arrives on `barrier` and adds `bytes` to the transaction count its current phase waits for.
__device__ inline void MbarrierArriveExpectTx(uint64_t* barrier, unsigned bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddress(barrier)),
      "r"(bytes)
      : "memory");
}
__device__ inline void MbarrierWait(uint64_t* barrier, unsigned phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(SharedAddress(barrier)),
      "r"(phase)
      : "memory");
}
// The copy engine moves `bytes` (a multiple of 16) from global to shared memory and signals
// `barrier` with them (Hopper's bulk copy: one instruction per row instead of 16-byte copies).
__device__ inline void BulkCopyToShared(void* smem_dest, const void* global_source, unsigned bytes,
                                        uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SharedAddress(smem_dest)),
      "l"(global_source), "r"(bytes), "r"(SharedAddress(barrier))
      : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy
// (copy engine) ones: a stage is refilled by bulk copies right after it was read by ld.shared.
__device__ inline void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ inline uint2 LoadShared64(const void* smem) {
  return *reinterpret_cast<const uint2*>(smem);
}

// Four 8x8 bf16 matrices, transposed: register i of lane (g, t) holds rows 2t, 2t+1 of column g
// of matrix i, where lane 8i + r supplies the address of row r of matrix i.
__device__ inline void LdMatrixX4Trans(const void* smem_row, uint32_t& r0, uint32_t& r1,
                                       uint32_t& r2, uint32_t& r3) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(address));
}

// c += A B for one m16n8k16 tile, A rows g+8 being zero (a1 = a3 = 0).
__device__ inline void MmaRowsBelow8(float (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0,
                                     uint32_t b1) {
  const uint32_t zero = 0;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(zero), "r"(a2), "r"(zero), "r"(b0), "r"(b1));
}

__device__ inline uint32_t PackBf16x2(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// ---- split kernel ---------------------------------------------------------------------------

// Where a launch puts its partial results (all in the caller's workspace).
struct SplitOutputs {
  int num_splits = 0;
  int keys_per_split = 0;
  float* partial_out = nullptr;  // [batch][num_heads][num_splits][head_dim], f32, normalized
  float* partial_lse = nullptr;  // [batch][num_heads][num_splits], f32, log2 units; -inf: empty
  float* lse2 = nullptr;         // [batch][num_heads], f32, log2 units (written by the merge)
  float* scores = nullptr;       // [batch][num_heads][max_seq_len], f32, log2 units, or null
};

template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    DecodeAttentionSplitKernel(const DecodeAttentionParams params, const SplitOutputs outputs) {
  using Layout = TileLayout<kHeadDim>;
  static_assert(kGroup <= 8, "the group's query rows must fit the MMA's first 8 rows");
  static_assert((kHeadDim / 8) % 2 == 0, "P V consumes dims in pairs of 8-column blocks");
  extern __shared__ __align__(128) unsigned char smem[];

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int sequence = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row = lane / 4;   // MMA "group id": query row g, and key / dim column g
  const int quad = lane % 4;  // MMA "thread in group"
  const int first_head = kv_head * kGroup;

  const int seq_len = min(params.seq_lens[sequence], params.max_seq_len);
  const VisibleKeys visible = VisibleKeysOf(seq_len, params.sink_tokens, params.recent_tokens);
  const int begin = split * outputs.keys_per_split;
  const int end = min(begin + outputs.keys_per_split, visible.count);
  const size_t partial_row0 =
      (static_cast<size_t>(sequence) * params.num_heads + first_head) * outputs.num_splits + split;
  if (begin >= end) {  // nothing to attend in this split: the merge gives it weight 0
    if (threadIdx.x < kGroup) {
      outputs.partial_lse[partial_row0 + static_cast<size_t>(threadIdx.x) * outputs.num_splits] =
          -INFINITY;
    }
    return;
  }

  const int block_shift = params.block_tokens == 64 ? 6 : 4;
  const int32_t* block_table =
      params.block_tables + static_cast<size_t>(sequence) * params.block_table_stride;
  // Loading: thread i copies one row per tile, K row i of the tile for i < kTileKeys, V row
  // i - kTileKeys otherwise, with one bulk copy into its padded shared-memory row; the stage's
  // mbarrier completes when all of the tile's bytes have landed. Rows past the split's end are
  // zeroed instead (P is 0 there, and 0 x stale NaN would not be 0).
  static_assert(kThreads == kTileKeys || kThreads == 2 * kTileKeys, "whole rows per thread");
  constexpr int kRowsPerThread = 2 * kTileKeys / kThreads;  // rows r = threadIdx.x + i * kThreads
  constexpr int kRowDataBytes = kHeadDim * 2;
  __shared__ uint64_t stage_full[kStages];  // one mbarrier per stage, kThreads arrivals
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) MbarrierInit(&stage_full[s], kThreads);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Row r of a stage is K row r (r < kTileKeys) or V row r - kTileKeys; every row of a thread is
  // the same key (kThreads == kTileKeys: its K and its V row), so one block id serves them all.
  const int my_key = threadIdx.x % kTileKeys;
  // The physical block of this thread's key in the next tile to load, fetched one tile ahead:
  // a block-table read on the load path would stall the warp right when it issues copies.
  int next_block = 0;
  auto fetch_block = [&](int tile_begin) {
    const int index = tile_begin + my_key;
    next_block = index < end ? block_table[visible.Position(index) >> block_shift] : 0;
  };
  auto load_tile = [&](int tile_begin, int stage) {
    const int index = tile_begin + my_key;
    const bool valid = index < end;
    size_t offset = 0;
    if (valid) {
      const int position = visible.Position(index);
      offset =
          ((static_cast<size_t>(next_block) * params.num_kv_heads + kv_head) * params.block_tokens +
           (position & (params.block_tokens - 1))) *
          kHeadDim;
      FenceProxyAsyncShared();
    }
    MbarrierArriveExpectTx(&stage_full[stage], valid ? kRowsPerThread * kRowDataBytes : 0);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = threadIdx.x + i * kThreads;
      const bool values = r >= kTileKeys;
      unsigned char* dest = smem + stage * Layout::kStageBytes + (values ? Layout::kTileBytes : 0) +
                            my_key * Layout::kRowBytes;
      if (valid) {
        BulkCopyToShared(dest, (values ? params.value_pool : params.key_pool) + offset,
                         kRowDataBytes, &stage_full[stage]);
      } else {
#pragma unroll
        for (int c = 0; c < kRowDataBytes / 16; ++c) {
          reinterpret_cast<uint4*>(dest)[c] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    fetch_block(tile_begin + kTileKeys);
  };

  const int num_tiles = (end - begin + kTileKeys - 1) / kTileKeys;
  fetch_block(begin);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_tile(begin + s * kTileKeys, s);
  }

  // Q as MMA A fragments, loaded once the first tiles' copies are in flight. Q K^T sums over the
  // head dims, so any one order of them serves as long as Q and K agree: k-step s, thread q
  // takes dims 16s + 4q .. + 3, as a0 (dims +0, +1; MMA columns 2q, 2q + 1) and a2 (dims +2, +3;
  // columns 8 + 2q, 9 + 2q). Each K fragment is then one 8-byte shared load, and the 16 lanes of
  // a half-warp (rows g..g+3, 32 bytes each) cover the 32 banks once with 32-byte aligned rows.
  uint32_t q_frag[kHeadDim / 16][2];
  {
    const __nv_bfloat16* q_row =
        params.q + sequence * params.q_row_stride + (first_head + row) * kHeadDim;
#pragma unroll
    for (int s = 0; s < kHeadDim / 16; ++s) {
      const uint2 dims = row < kGroup ? *reinterpret_cast<const uint2*>(q_row + 16 * s + 4 * quad)
                                      : make_uint2(0u, 0u);
      q_frag[s][0] = dims.x;
      q_frag[s][1] = dims.y;
    }
  }

  const float scale_log2 = params.scale * kLog2e;
  float row_max = -INFINITY;   // running max of row g's scores (log2 units), same in the quad
  float row_sum = 0.f;         // this thread's share of row g's sum of exp2(score - row_max)
  float out[kHeadDim / 8][4];  // C fragments of P V: [0], [1] = row g, dims 8n + 2q, +1
#pragma unroll
  for (int n = 0; n < kHeadDim / 8; ++n) out[n][0] = out[n][1] = out[n][2] = out[n][3] = 0.f;

  for (int tile = 0; tile < num_tiles; ++tile) {
    // Every warp is done with tile - 1, whose stage the next load refills.
    __syncthreads();
    {
      const int next = tile + kStages - 1;
      if (next < num_tiles) load_tile(begin + next * kTileKeys, next % kStages);
    }
    MbarrierWait(&stage_full[tile % kStages], (tile / kStages) & 1);
    const unsigned char* k_tile = smem + (tile % kStages) * Layout::kStageBytes;
    const unsigned char* v_tile = k_tile + Layout::kTileBytes;
    const int warp_key0 = warp * kKeysPerWarp;  // this warp's first key row in the tile

    // S = Q K^T for the warp's keys: n-block j covers keys warp_key0 + 8j .. + 7.
    float score[kScoreBlocks][4];
#pragma unroll
    for (int j = 0; j < kScoreBlocks; ++j) {
      score[j][0] = score[j][1] = score[j][2] = score[j][3] = 0.f;
      const unsigned char* key_row = k_tile + (warp_key0 + 8 * j + row) * Layout::kRowBytes;
#pragma unroll
      for (int s = 0; s < kHeadDim / 16; ++s) {
        const uint2 b = LoadShared64(key_row + (16 * s + 4 * quad) * 2);  // dims as Q's
        MmaRowsBelow8(score[j], q_frag[s][0], q_frag[s][1], b.x, b.y);
      }
    }

    // Scale, mask keys past the split's end, online softmax for row g.
    const int index0 = begin + tile * kTileKeys + warp_key0;  // visible index of key row 0
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kScoreBlocks; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int index = index0 + 8 * j + 2 * quad + e;
        const float x = index < end ? score[j][e] * scale_log2 : -INFINITY;
        score[j][e] = x;
        tile_max = fmaxf(tile_max, x);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(row_max, tile_max);
    const float base = new_max == -INFINITY ? 0.f : new_max;  // all masked so far: no NaN
    const float correction = exp2f(row_max - base);
    row_max = new_max;
    row_sum *= correction;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      out[n][0] *= correction;
      out[n][1] *= correction;
    }
    float prob[kScoreBlocks][2];
#pragma unroll
    for (int j = 0; j < kScoreBlocks; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        prob[j][e] = exp2f(score[j][e] - base);
        row_sum += prob[j][e];
      }
    }
    if (outputs.scores != nullptr && row < kGroup) {  // raw scores for the probabilities output
      float* score_row =
          outputs.scores + (static_cast<size_t>(sequence) * params.num_heads + first_head + row) *
                               params.max_seq_len;
#pragma unroll
      for (int j = 0; j < kScoreBlocks; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int index = index0 + 8 * j + 2 * quad + e;
          if (index < end) score_row[visible.Position(index)] = score[j][e];
        }
      }
    }

    // O += P V, one k-step of 16 keys at a time: P as A fragments straight from the score
    // registers (keys 2q.. of n-block 2k are columns 2q.. of k-step k, n-block 2k+1's are
    // columns 8 + 2q..); V via ldmatrix.trans.
    const int matrix = lane / 8;
#pragma unroll
    for (int k = 0; k < kKeySteps; ++k) {
      const uint32_t p_low = PackBf16x2(prob[2 * k][0], prob[2 * k][1]);
      const uint32_t p_high = PackBf16x2(prob[2 * k + 1][0], prob[2 * k + 1][1]);
      const unsigned char* v_row =
          v_tile + (warp_key0 + 16 * k + (matrix & 1) * 8 + lane % 8) * Layout::kRowBytes +
          (matrix >> 1) * 16;
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; n += 2) {
        uint32_t b0, b1, b0_next, b1_next;
        LdMatrixX4Trans(v_row + n * 16, b0, b1, b0_next, b1_next);
        MmaRowsBelow8(out[n], p_low, p_high, b0, b1);
        MmaRowsBelow8(out[n + 1], p_low, p_high, b0_next, b1_next);
      }
    }
  }
  __syncthreads();  // every copy landed and was read: reuse the stages to merge the warps

  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 2);
  float* warp_max = reinterpret_cast<float*>(smem);  // [kWarps][8]
  float* warp_sum = warp_max + kWarps * 8;           // [kWarps][8]
  float* warp_out = warp_sum + kWarps * 8;           // [kWarps][8][kHeadDim]
  if (row < kGroup) {
    if (quad == 0) {
      warp_max[warp * 8 + row] = row_max;
      warp_sum[warp * 8 + row] = row_sum;
    }
    float* dest = warp_out + (warp * 8 + row) * kHeadDim;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      dest[8 * n + 2 * quad] = out[n][0];
      dest[8 * n + 2 * quad + 1] = out[n][1];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim;
    const int d = i % kHeadDim;
    float block_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, warp_max[w * 8 + r]);
    const float base = block_max == -INFINITY ? 0.f : block_max;
    float numerator = 0.f, denominator = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(warp_max[w * 8 + r] - base);
      numerator += weight * warp_out[(w * 8 + r) * kHeadDim + d];
      denominator += weight * warp_sum[w * 8 + r];
    }
    const size_t partial_row = partial_row0 + static_cast<size_t>(r) * outputs.num_splits;
    outputs.partial_out[partial_row * kHeadDim + d] = numerator / denominator;
    if (d == 0) outputs.partial_lse[partial_row] = base + log2f(denominator);
  }
}

// ---- merge kernels --------------------------------------------------------------------------

// One block per (sequence, head): weights the splits by exp2(lse_s - max) and writes the bf16
// output, the natural-log LSE and the log2 LSE the probabilities kernel needs.
template <int kHeadDim>
__global__ void __launch_bounds__(128)
    DecodeAttentionMergeKernel(const DecodeAttentionParams params, const SplitOutputs outputs) {
  extern __shared__ float split_weight[];  // [num_splits]
  __shared__ float reduce[32];
  const int sequence = blockIdx.x / params.num_heads;
  const int head = blockIdx.x % params.num_heads;
  const size_t row = static_cast<size_t>(sequence) * params.num_heads + head;
  const float* lse = outputs.partial_lse + row * outputs.num_splits;

  float local_max = -INFINITY;
  for (int s = threadIdx.x; s < outputs.num_splits; s += blockDim.x)
    local_max = fmaxf(local_max, lse[s]);
  for (int offset = 16; offset > 0; offset /= 2)
    local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, offset));
  if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = local_max;
  __syncthreads();
  float max_lse = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) max_lse = fmaxf(max_lse, reduce[w]);
  const float base = max_lse == -INFINITY ? 0.f : max_lse;
  float local_sum = 0.f;
  for (int s = threadIdx.x; s < outputs.num_splits; s += blockDim.x) {
    const float weight = lse[s] == -INFINITY ? 0.f : exp2f(lse[s] - base);
    split_weight[s] = weight;
    local_sum += weight;
  }
  for (int offset = 16; offset > 0; offset /= 2)
    local_sum += __shfl_xor_sync(0xffffffffu, local_sum, offset);
  __syncthreads();  // everyone has read reduce[] (the max) before it is reused for the sum
  if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = local_sum;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += reduce[w];

  const float* partial = outputs.partial_out + row * outputs.num_splits * kHeadDim;
  __nv_bfloat16* out = params.out + sequence * params.out_row_stride + head * kHeadDim;
  for (int d = threadIdx.x; d < kHeadDim; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < outputs.num_splits; ++s) {
      if (split_weight[s] != 0.f) acc += split_weight[s] * partial[s * kHeadDim + d];
    }
    out[d] = __float2bfloat16_rn(total > 0.f ? acc / total : 0.f);
  }
  if (threadIdx.x == 0) {
    const float lse2 = total > 0.f ? base + log2f(total) : -INFINITY;
    if (outputs.lse2 != nullptr) outputs.lse2[row] = lse2;
    if (params.lse != nullptr) params.lse[row] = lse2 * kLn2;
  }
}

// Probabilities averaged over the GQA group, per key position; 0 where the window hides a key.
template <int kGroup>
__global__ void DecodeAttentionProbsKernel(const DecodeAttentionParams params,
                                           const SplitOutputs outputs) {
  const int sequence = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int position = blockIdx.x * blockDim.x + threadIdx.x;
  const int seq_len = min(params.seq_lens[sequence], params.max_seq_len);
  if (position >= seq_len) return;
  const VisibleKeys visible = VisibleKeysOf(seq_len, params.sink_tokens, params.recent_tokens);
  const bool attended = position < visible.sink_end || position >= visible.recent_begin;
  float mean = 0.f;
  if (attended) {
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      const size_t row = static_cast<size_t>(sequence) * params.num_heads + kv_head * kGroup + r;
      mean += exp2f(outputs.scores[row * params.max_seq_len + position] - outputs.lse2[row]);
    }
    mean /= kGroup;
  }
  params.kv_head_probs[(static_cast<size_t>(sequence) * params.num_kv_heads + kv_head) *
                           params.probs_stride +
                       position] = mean;
}

// ---- launcher -------------------------------------------------------------------------------

// The merge kernel's split weights, padded by 16 bytes: ptxas may widen the loop's last loads
// into one vector load past the final weight (compute-sanitizer saw 12-byte reads there).
size_t MergeSharedBytes(int num_splits) {
  return (static_cast<size_t>(num_splits) + 4) * sizeof(float);
}

int MaxSplits(int max_seq_len) { return (max_seq_len + kMinKeysPerSplit - 1) / kMinKeysPerSplit; }

struct WorkspaceLayout {
  size_t partial_out = 0, partial_lse = 0, lse2 = 0, scores = 0, total = 0;
};

WorkspaceLayout LayoutWorkspace(int batch, int num_heads, int head_dim, int max_seq_len,
                                bool want_probs) {
  const size_t rows = static_cast<size_t>(batch) * num_heads;
  const size_t splits = static_cast<size_t>(MaxSplits(max_seq_len));
  auto align = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  WorkspaceLayout layout;
  layout.partial_out = 0;
  layout.partial_lse = align(layout.partial_out + rows * splits * head_dim * sizeof(float));
  layout.lse2 = align(layout.partial_lse + rows * splits * sizeof(float));
  layout.scores = align(layout.lse2 + rows * sizeof(float));
  layout.total =
      want_probs ? align(layout.scores + rows * max_seq_len * sizeof(float)) : layout.scores;
  return layout;
}

constexpr int kMaxCachedDevices = 64;  // devices past this are queried on every launch

int CurrentDevice() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return device;
}

// Multiprocessors of the current device: sizes the split count, never correctness. Queried once
// per device: the launch path runs on every decode step, and host time between a step's first
// event and its kernel is time the GPU idles when the step is not a graph replay.
int MultiprocessorCount() {
  static std::array<std::atomic<int>, kMaxCachedDevices> cached{};  // 0: not queried yet
  const int device = CurrentDevice();
  if (device < kMaxCachedDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      value < 1) {
    cudaGetLastError();
    return 132;  // H100 SXM / H200
  }
  if (device < kMaxCachedDevices) cached[device].store(value, std::memory_order_relaxed);
  return value;
}

// Raises a split kernel's dynamic shared-memory limit, once per (instantiation, device): the
// opt-in is per device, and a repeated call costs host time on every launch.
template <int kHeadDim, int kGroup>
Status AllowSplitKernelSharedMemory(int bytes) {
  static std::array<std::atomic<bool>, kMaxCachedDevices> raised{};
  const int device = CurrentDevice();
  if (device < kMaxCachedDevices && raised[device].load(std::memory_order_acquire)) {
    return Status::Ok();
  }
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(DecodeAttentionSplitKernel<kHeadDim, kGroup>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
      "raising decode attention's shared memory limit");
  if (device < kMaxCachedDevices) raised[device].store(true, std::memory_order_release);
  return Status::Ok();
}

// Splits per sequence: as many as keep every block resident for the whole launch (one wave of
// multiprocessors x kBlocksPerSm blocks), so that no block pays a pipeline fill while others
// stream, and no last wave runs mostly empty. Measured on an H200 at 16 x 8 KV heads
// (bench/results/decode_attention_notes.md): one wave beat 8-16 waves by 11 % at 8K and 3 % at
// 32K, and tied at 128K. Never fewer than kMinKeysPerSplit keys per split; with more (sequence,
// KV head) pairs than slots, one split each.
int ChooseSplits(int pairs, int max_visible) {
  const int slots = MultiprocessorCount() * kBlocksPerSm;
  const int most = std::max(1, max_visible / kMinKeysPerSplit);
  return std::clamp(slots / pairs, 1, most);
}

template <int kHeadDim, int kGroup>
Status Launch(const DecodeAttentionParams& params, const WorkspaceLayout& layout,
              cudaStream_t stream) {
  // The window bounds the keys any sequence attends.
  const long long window_keys = static_cast<long long>(params.sink_tokens) + params.recent_tokens;
  const int max_visible = static_cast<int>(std::min<long long>(params.max_seq_len, window_keys));
  SplitOutputs outputs;
  int splits = params.num_splits > 0
                   ? params.num_splits
                   : ChooseSplits(params.batch * params.num_kv_heads, max_visible);
  splits = std::min(splits, MaxSplits(params.max_seq_len));  // what the workspace holds
  outputs.keys_per_split = (max_visible + splits - 1) / splits;
  outputs.num_splits = (max_visible + outputs.keys_per_split - 1) / outputs.keys_per_split;
  unsigned char* workspace = static_cast<unsigned char*>(params.workspace);
  outputs.partial_out = reinterpret_cast<float*>(workspace + layout.partial_out);
  outputs.partial_lse = reinterpret_cast<float*>(workspace + layout.partial_lse);
  outputs.lse2 = reinterpret_cast<float*>(workspace + layout.lse2);
  outputs.scores = params.kv_head_probs != nullptr
                       ? reinterpret_cast<float*>(workspace + layout.scores)
                       : nullptr;

  constexpr int kSmem = TileLayout<kHeadDim>::kSmemBytes;
  RUBATO_RETURN_IF_ERROR((AllowSplitKernelSharedMemory<kHeadDim, kGroup>(kSmem)));

  const dim3 grid(outputs.num_splits, params.num_kv_heads, params.batch);
  DecodeAttentionSplitKernel<kHeadDim, kGroup><<<grid, kThreads, kSmem, stream>>>(params, outputs);
  RUBATO_RETURN_IF_ERROR(LaunchStatus("decode_attention_split"));

  DecodeAttentionMergeKernel<kHeadDim>
      <<<params.batch * params.num_heads, 128, MergeSharedBytes(outputs.num_splits), stream>>>(
          params, outputs);
  RUBATO_RETURN_IF_ERROR(LaunchStatus("decode_attention_merge"));

  if (params.kv_head_probs != nullptr) {
    constexpr int kProbThreads = 256;
    const dim3 probs_grid((params.max_seq_len + kProbThreads - 1) / kProbThreads,
                          params.num_kv_heads, params.batch);
    DecodeAttentionProbsKernel<kGroup><<<probs_grid, kProbThreads, 0, stream>>>(params, outputs);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("decode_attention_probs"));
  }
  return Status::Ok();
}

Status Validate(const DecodeAttentionParams& p) {
  auto invalid = [](const std::string& what) {
    return InvalidArgumentError("decode attention: " + what);
  };
  if (p.q == nullptr || p.key_pool == nullptr || p.value_pool == nullptr ||
      p.block_tables == nullptr || p.seq_lens == nullptr || p.out == nullptr) {
    return invalid("q, key_pool, value_pool, block_tables, seq_lens and out must be set");
  }
  if (p.batch < 1) return invalid("batch " + std::to_string(p.batch) + " < 1");
  if (p.num_kv_heads < 1 || p.num_heads < 1 || p.num_heads % p.num_kv_heads != 0) {
    return invalid("num_heads " + std::to_string(p.num_heads) + " is not a positive multiple of " +
                   "num_kv_heads " + std::to_string(p.num_kv_heads));
  }
  if (p.block_tokens != 16 && p.block_tokens != 64) {
    return invalid("block_tokens " + std::to_string(p.block_tokens) + " (expected 16 or 64)");
  }
  if (p.max_seq_len < 1) return invalid("max_seq_len " + std::to_string(p.max_seq_len) + " < 1");
  if (static_cast<long long>(p.block_table_stride) * p.block_tokens < p.max_seq_len) {
    return invalid("block_table_stride " + std::to_string(p.block_table_stride) +
                   " blocks cannot hold max_seq_len " + std::to_string(p.max_seq_len));
  }
  if (p.sink_tokens < 0 || p.recent_tokens < 1) {
    return invalid("window sink " + std::to_string(p.sink_tokens) + " / recent " +
                   std::to_string(p.recent_tokens) + " (need sink >= 0, recent >= 1)");
  }
  if (!std::isfinite(p.scale)) return invalid("scale is not finite");
  if (!Aligned16(p.q) || !Aligned16(p.key_pool) || !Aligned16(p.value_pool) ||
      p.q_row_stride % 8 != 0) {
    return invalid(
        "q, key_pool and value_pool must be 16-byte aligned, q_row_stride a multiple of 8");
  }
  if (p.q_row_stride < static_cast<int64_t>(p.num_heads) * p.head_dim ||
      p.out_row_stride < static_cast<int64_t>(p.num_heads) * p.head_dim) {
    return invalid("q_row_stride / out_row_stride smaller than num_heads * head_dim");
  }
  if (p.kv_head_probs != nullptr && p.probs_stride < p.max_seq_len) {
    return invalid("probs_stride " + std::to_string(p.probs_stride) + " < max_seq_len " +
                   std::to_string(p.max_seq_len));
  }
  const size_t needed = DecodeAttentionWorkspaceBytes(p.batch, p.num_heads, p.head_dim,
                                                      p.max_seq_len, p.kv_head_probs != nullptr);
  if (p.workspace == nullptr || p.workspace_bytes < needed) {
    return invalid("workspace of " + std::to_string(p.workspace_bytes) + " bytes; " +
                   std::to_string(needed) + " needed (DecodeAttentionWorkspaceBytes)");
  }
  return Status::Ok();
}

}  // namespace

size_t DecodeAttentionWorkspaceBytes(int batch, int num_heads, int head_dim, int max_seq_len,
                                     bool want_probs) {
  if (batch < 1 || num_heads < 1 || head_dim < 1 || max_seq_len < 1) return 0;
  return LayoutWorkspace(batch, num_heads, head_dim, max_seq_len, want_probs).total;
}

Status DecodeAttention(const DecodeAttentionParams& params, cudaStream_t stream) {
  RUBATO_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, {
    RUBATO_RETURN_IF_ERROR(Validate(params));
    const WorkspaceLayout layout =
        LayoutWorkspace(params.batch, params.num_heads, kHeadDim, params.max_seq_len,
                        params.kv_head_probs != nullptr);
    const int group = params.num_heads / params.num_kv_heads;
    RUBATO_DISPATCH_GQA_GROUP(group, kGroup,
                              { return Launch<kHeadDim, kGroup>(params, layout, stream); });
  });
}

}  // namespace rubato::cuda
