// Decode attention's split kernel (decode_attention.cu launches it, then merges the partials):
// one block per (split, KV head, sequence) computes a partial softmax over a range of the keys
// for the GQA group, tiles of keys passing through shared-memory stages filled by tensor
// copies (whole KV blocks, dense windows) or row copies, S = Q K^T and P V on m16n8k16 MMAs.
// Compile-time variants add a compact segment, raw scores or slot arrays (whose eviction choice
// a single split makes in its epilogue, slot_choice.cuh). docs/decode_attention.md.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/decode_attention_keys.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/slot_choice.cuh"

namespace rubato::cuda::decode_attention {

// Row copies' stage: a K tile then a V tile, each [kTileKeys][row], a row being head_dim bf16 plus
// 32 bytes of padding. The copy engine splits a bulk copy where its destination crosses a
// 128-byte boundary, and a source sector straddling such a split is read from L2 twice: with
// rows 32-byte aligned none straddles (16 bytes of padding cost 11 % more L2 sector reads and
// 1.6 % of the time at 16 x 128K). Q K^T sums over the head dims, so the dims may be taken in any
// order Q and K share: k-step s, thread q takes dims 16s + 4q .. + 3 as one 8-byte shared load,
// and the 16 lanes of a half-warp (rows g..g+3, 32 bytes each) cover the 32 banks once. V's
// ldmatrix rows (16 bytes, 8 rows per phase) see a 2-way bank conflict, rows r and r + 4.
template <int kHeadDim>
struct PaddedTiles {
  static constexpr int kRowBytes = kHeadDim * 2 + 32;
  static constexpr int kTileBytes = kTileKeys * kRowBytes;
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  // Byte offset of 16-byte chunk `chunk` (0 .. head_dim / 8 - 1) of `row` within a tile.
  __device__ static int Offset(int row, int chunk) { return row * kRowBytes + chunk * 16; }
  // Q's A fragment for k-step s: a0 = dims 16s + 4q, +1; a2 = dims 16s + 4q + 2, +3.
  __device__ static uint2 QueryFragment(const __nv_bfloat16* q_row, int s, int quad) {
    return *reinterpret_cast<const uint2*>(q_row + 16 * s + 4 * quad);
  }
  // K's B fragment of key `row` for k-step s, in Q's dim order.
  __device__ static uint2 KeyFragment(const unsigned char* k_tile, int row, int s, int quad) {
    return *reinterpret_cast<const uint2*>(k_tile + row * kRowBytes + 32 * s + 8 * quad);
  }
};

// Tensor copies' stage: each K (or V) tile is head_dim / 64 "halves" of [kTileKeys rows][128
// bytes] in the 128-byte swizzle (16-byte chunk c of row r sits at chunk c ^ (r % 8)), which
// spreads the 8 rows an MMA fragment or an ldmatrix phase reads over all banks without padding.
// Dims in MMA order (k-step s, thread q: dims 16s + 2q, +1 and 16s + 8 + 2q, +1), two 4-byte
// loads per K fragment: an 8-byte load of 4 adjacent dims would meet its neighbour row's in the
// swizzle. Tiles need 1024-byte alignment: one extra KB of slack.
template <int kHeadDim>
struct SwizzledTiles {
  static constexpr int kHalfBytes = kTileKeys * 128;
  static constexpr int kTileBytes = kHeadDim / 64 * kHalfBytes;
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;
  __device__ static int Offset(int row, int chunk) {
    return (chunk / 8) * kHalfBytes + row * 128 + (((chunk % 8) ^ (row & 7)) << 4);
  }
  __device__ static uint2 QueryFragment(const __nv_bfloat16* q_row, int s, int quad) {
    return make_uint2(*reinterpret_cast<const uint32_t*>(q_row + 16 * s + 2 * quad),
                      *reinterpret_cast<const uint32_t*>(q_row + 16 * s + 8 + 2 * quad));
  }
  __device__ static uint2 KeyFragment(const unsigned char* k_tile, int row, int s, int quad) {
    return make_uint2(
        *reinterpret_cast<const uint32_t*>(k_tile + Offset(row, 2 * s) + 4 * quad),
        *reinterpret_cast<const uint32_t*>(k_tile + Offset(row, 2 * s + 1) + 4 * quad));
  }
};

template <int kHeadDim, bool kTensorCopies>
using TilesFor = std::conditional_t<kTensorCopies, SwizzledTiles<kHeadDim>, PaddedTiles<kHeadDim>>;

// Four 8x8 bf16 matrices, transposed: register i of lane (g, t) holds rows 2t, 2t+1 of column g
// of matrix i, where lane 8i + r supplies the address of row r of matrix i.
__device__ inline void LdMatrixX4Trans(const void* smem_row, uint32_t& r0, uint32_t& r1,
                                       uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(SharedAddress(smem_row)));
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

// Where a launch puts its partial results (all in the caller's workspace).
struct SplitOutputs {
  int num_splits = 0;
  int keys_per_split = 0;        // a multiple of kTileKeys with tensor copies
  float* partial_out = nullptr;  // [batch][num_heads][num_splits][head_dim], f32, normalized
  float* partial_lse = nullptr;  // [batch][num_heads][num_splits], f32, log2 units; -inf: empty
  float* lse2 = nullptr;         // [batch][num_heads], f32, log2 units (written by the merge)
  float* scores = nullptr;       // [batch][num_heads][scores_stride], f32, log2 units, or null
  int64_t scores_stride = 0;     // the caller's (params.scores) or max_seq_len (workspace)
  // Slot launches with one split and the in-block eviction choice: the launch adds
  // kSlotChoiceSmemBytes of shared memory (two blocks a multiprocessor with tensor copies, the
  // occupancy that measured fastest: 2-4 % less time than three at B = 2400 and 3200), where
  // the group's raw scores of the first slot_smem_slots slots stay instead of a round trip
  // through L2 and HBM (the rest, if any, go to `scores`). 0: none.
  int slot_smem_slots = 0;
};

// The shared memory a slot launch with the in-block choice adds after the tiles: 45 KB, so that
// two blocks with tensor-copy tiles (65 KB) and the reduction's static arrays fit a Hopper
// multiprocessor (228 KB, 1 KB reserved per block): the raw scores of up to 11520 / kGroup
// slots (2880 at GQA 4: all of B = 2400, 90 % of B = 3200).
constexpr int kSlotChoiceSmemBytes = 45 * 1024;

// kTensorCopies needs: head_dim 64 or 128, a dense window (visible index == position), split
// ranges starting on tile boundaries, and key_map / value_map over the pools' rows
// ([blocks * num_kv_heads * block_tokens][head_dim], boxes of 64 dims x block_tokens rows), plus
// compact_key_map / compact_value_map over the compact buffers' rows ([buffers * num_kv_heads *
// compact_capacity][head_dim], the same boxes; buffers = num_compact_slots with compact_slots,
// else batch) for two-segment launches. Maps a launch does not use are ignored.
template <int kHeadDim, int kGroup, bool kTensorCopies, class Variant>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    DecodeAttentionSplitKernel(const DecodeAttentionParams params, const SplitOutputs outputs,
                               const __grid_constant__ CUtensorMap key_map,
                               const __grid_constant__ CUtensorMap value_map,
                               const __grid_constant__ CUtensorMap compact_key_map,
                               const __grid_constant__ CUtensorMap compact_value_map) {
  using Tiles = TilesFor<kHeadDim, kTensorCopies>;
  static_assert(kGroup <= 8, "the group's query rows must fit the MMA's first 8 rows");
  static_assert((kHeadDim / 8) % 2 == 0, "P V consumes dims in pairs of 8-column blocks");
  static_assert(!kTensorCopies || kHeadDim % 64 == 0, "tensor copies move 64-dim halves");
  static_assert(!(kTensorCopies && Variant::kList), "listed positions come by row copies");
  static_assert(Variant::kValues || Variant::kScores, "a pass without values writes scores");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  WaitForPriorGrids();
  unsigned char* smem = smem_raw;
  // After the tiles (and the tensor copies' alignment slack): a slot launch's raw scores.
  [[maybe_unused]] float* shared_scores = reinterpret_cast<float*>(smem_raw + Tiles::kSmemBytes);
  if constexpr (kTensorCopies) {  // swizzled tiles start on a 1024-byte boundary
    const unsigned address = SharedAddress(smem_raw);
    smem += ((address + 1023u) & ~1023u) - address;
  }

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int sequence = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row = lane / 4;   // MMA "group id": query row g, and key / dim column g
  const int quad = lane % 4;  // MMA "thread in group"
  const int first_head = kv_head * kGroup;

  const int seq_len =
      Variant::kList || Variant::kSlots ? 0 : min(params.seq_lens[sequence], params.max_seq_len);
  const KeySpaceFor<Variant> keys = KeySpaceOf<Variant>(params, sequence, kv_head, seq_len);
  const int begin = split * outputs.keys_per_split;
  const int end = min(begin + outputs.keys_per_split, keys.count);
  const size_t partial_row0 =
      (static_cast<size_t>(sequence) * params.num_heads + first_head) * outputs.num_splits + split;
  if (begin >= end) {  // nothing to attend in this split: the merge gives it weight 0
    if ((Variant::kValues || outputs.partial_lse != nullptr) && threadIdx.x < kGroup) {
      outputs.partial_lse[partial_row0 + static_cast<size_t>(threadIdx.x) * outputs.num_splits] =
          -INFINITY;
    }
    return;
  }

  const int block_shift = params.block_tokens == 64 ? 6 : 4;
  const int32_t* block_table =
      params.block_tables + static_cast<size_t>(sequence) * params.block_table_stride;
  constexpr int kRowDataBytes = kHeadDim * 2;
  // One mbarrier per stage: every thread arrives (row copies) or thread 0 alone (tensor copies).
  __shared__ uint64_t stage_full[kStages];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) MbarrierInit(&stage_full[s], kTensorCopies ? 1 : kThreads);
    FenceMbarrierInit();
  }
  __syncthreads();

  // Row copies: thread i copies K row i of the tile (i < kTileKeys) or V row i - kTileKeys into
  // its padded row; rows past the split's end are zeroed instead (P is 0 there, and 0 x stale NaN
  // would not be 0). The physical block of the thread's key in the next tile is fetched one tile
  // ahead: a block-table read on the load path would stall the warp right when it issues copies.
  const int my_key = threadIdx.x % kTileKeys;
  const bool loads_values = threadIdx.x >= kTileKeys;
  int next_block = 0;
  const size_t compact_row0 = static_cast<size_t>(keys.compact_row0);
  auto fetch_row_block = [&](int tile_begin) {
    const int index = tile_begin + my_key;
    next_block = !Variant::kSlots && index < end && !keys.IsCompact(index) && keys.Attended(index)
                     ? block_table[keys.Position(index) >> block_shift]
                     : 0;
  };
  auto load_rows = [&](int tile_begin, int stage) {
    if (!Variant::kValues && loads_values) {  // a scores-only pass reads no values
      MbarrierArriveExpectTx(&stage_full[stage], 0);
      return;
    }
    const int index = tile_begin + my_key;
    unsigned char* dest = smem + stage * Tiles::kStageBytes +
                          (loads_values ? Tiles::kTileBytes : 0) + Tiles::Offset(my_key, 0);
    if (index < end && keys.Attended(index)) {
      const __nv_bfloat16* source;
      if constexpr (Variant::kSlots) {
        source = (loads_values ? params.slot_values : params.slot_keys) +
                 (keys.slot_row0 + index) * kHeadDim;
      } else if (keys.IsCompact(index)) {
        source = (loads_values ? params.compact_values : params.compact_keys) +
                 (compact_row0 + index) * kHeadDim;
      } else {
        const int position = keys.Position(index);
        source = (loads_values ? params.value_pool : params.key_pool) +
                 ((static_cast<size_t>(next_block) * params.num_kv_heads + kv_head) *
                      params.block_tokens +
                  (position & (params.block_tokens - 1))) *
                     kHeadDim;
      }
      FenceProxyAsyncShared();
      MbarrierArriveExpectTx(&stage_full[stage], kRowDataBytes);
      BulkCopyToShared(dest, source, kRowDataBytes, &stage_full[stage]);
    } else {
#pragma unroll
      for (int c = 0; c < kRowDataBytes / 16; ++c) {
        reinterpret_cast<uint4*>(dest)[c] = make_uint4(0, 0, 0, 0);
      }
      MbarrierArriveExpectTx(&stage_full[stage], 0);
    }
    fetch_row_block(tile_begin + kTileKeys);
  };

  // Tensor copies: thread 0 fetches the tile's block ids (one per block_tokens keys) one tile
  // ahead and issues one box per block, K and V, per 64-dim half. Tiles start on block
  // boundaries (dense window, splits of whole tiles), so a box never crosses into another block.
  // A compact tile is kTileKeys contiguous rows of the compact buffer, copied as boxes of
  // block_tokens rows too; boxes holding no attended row are skipped. A slot tile is one box of
  // kTileKeys rows of the slot arrays (the rows past the array's budget belong to the next one,
  // and are zeroed below with the invalid rows).
  constexpr int kMaxTileBlocks = kTileKeys / 16;
  const int box_rows = Variant::kSlots ? kTileKeys : params.block_tokens;
  int next_tile_rows[kMaxTileBlocks];  // map row of each box; -1: nothing to attend there
  bool next_tile_compact = false;
  const int tile_blocks = kTileKeys >> block_shift;
  auto fetch_tile_blocks = [&](int tile_begin) {
    if constexpr (Variant::kSlots) {  // one box of kTileKeys rows of the slot array
      next_tile_compact = true;
#pragma unroll
      for (int b = 0; b < kMaxTileBlocks; ++b) next_tile_rows[b] = -1;
      if (tile_begin < end) next_tile_rows[0] = static_cast<int>(keys.slot_row0 + tile_begin);
      return;
    }
    next_tile_compact = keys.IsCompact(tile_begin);
#pragma unroll
    for (int b = 0; b < kMaxTileBlocks; ++b) {
      const int first = tile_begin + b * params.block_tokens;
      const int last = first + params.block_tokens - 1;
      int map_row = -1;
      if (b < tile_blocks && first < end) {
        if (next_tile_compact) {
          if (first < keys.compact_count) map_row = static_cast<int>(compact_row0 + first);
        } else if (keys.Position(last) >= keys.paged_valid_begin) {
          map_row =
              (block_table[keys.Position(first) >> block_shift] * params.num_kv_heads + kv_head) *
              params.block_tokens;
        }
      }
      next_tile_rows[b] = map_row;
    }
  };
  auto load_blocks = [&](int stage) {  // thread 0 only
    int boxes = 0;
#pragma unroll
    for (int b = 0; b < kMaxTileBlocks; ++b) boxes += next_tile_rows[b] >= 0 ? 1 : 0;
    MbarrierArriveExpectTx(&stage_full[stage],
                           boxes * box_rows * kRowDataBytes * (Variant::kValues ? 2 : 1));
    unsigned char* k_dest = smem + stage * Tiles::kStageBytes;
    const CUtensorMap* k_map = next_tile_compact ? &compact_key_map : &key_map;
    const CUtensorMap* v_map = next_tile_compact ? &compact_value_map : &value_map;
#pragma unroll
    for (int b = 0; b < kMaxTileBlocks; ++b) {
      if (next_tile_rows[b] < 0) continue;
      const int dest_row = b * box_rows;
#pragma unroll
      for (int half = 0; half < kHeadDim / 64; ++half) {
        unsigned char* dest = k_dest + half * SwizzledTiles<kHeadDim>::kHalfBytes + dest_row * 128;
        TensorTileToShared(dest, k_map, half * 64, next_tile_rows[b], &stage_full[stage]);
        if constexpr (Variant::kValues) {
          TensorTileToShared(dest + Tiles::kTileBytes, v_map, half * 64, next_tile_rows[b],
                             &stage_full[stage]);
        }
      }
    }
  };

  auto load_tile = [&](int tile_begin, int stage) {
    if constexpr (kTensorCopies) {
      if (threadIdx.x == 0) {
        load_blocks(stage);
        fetch_tile_blocks(tile_begin + kTileKeys);
      }
    } else {
      load_rows(tile_begin, stage);
    }
  };

  const int num_tiles = (end - begin + kTileKeys - 1) / kTileKeys;
  if constexpr (kTensorCopies) {
    if (threadIdx.x == 0) fetch_tile_blocks(begin);
  } else {
    fetch_row_block(begin);
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_tile(begin + s * kTileKeys, s);
  }
  // Whether the split's slots have holes (invalid rows, whose V a whole-tile copy brings and
  // which must then be zeroed): decided once, so that a full slot array pays nothing per tile.
  // Sixteen independent byte loads a thread: one round trip for a split of 2048 slots. Without
  // holes no per-key validity is read again (a global load on every tile's critical path).
  bool slot_holes = false;
  if constexpr (Variant::kSlots) {
    int hole = 0;
    for (int i = begin + 16 * threadIdx.x; i < end; i += 16 * kThreads) {
#pragma unroll
      for (int e = 0; e < 16; ++e) hole |= i + e < end && !keys.Attended(i + e) ? 1 : 0;
    }
    slot_holes = __syncthreads_or(hole) != 0;
  }
  // Q as MMA A fragments in the tiles' dim order, loaded once the first copies are in flight.
  uint32_t q_frag[kHeadDim / 16][2];
  {
    const __nv_bfloat16* q_row =
        params.q + sequence * params.q_row_stride + (first_head + row) * kHeadDim;
#pragma unroll
    for (int s = 0; s < kHeadDim / 16; ++s) {
      const uint2 dims = row < kGroup ? Tiles::QueryFragment(q_row, s, quad) : make_uint2(0u, 0u);
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
    // Every warp is done with tile - 1, whose stage the next load refills; each thread's reads
    // of it are ordered before the copy engine's writes (the tensor path's issuing thread did
    // not make them all).
    if constexpr (kTensorCopies) FenceProxyAsyncShared();
    __syncthreads();
    {
      const int next = tile + kStages - 1;
      if (next < num_tiles) load_tile(begin + next * kTileKeys, next % kStages);
    }
    MbarrierWait(&stage_full[tile % kStages], (tile / kStages) & 1);
    const unsigned char* k_tile = smem + (tile % kStages) * Tiles::kStageBytes;
    const unsigned char* v_tile = k_tile + Tiles::kTileBytes;
    if constexpr (kTensorCopies && Variant::kValues) {
      // Whole boxes landed: V rows not attended (past the split's end, compact rows past the
      // count, paged positions below recent_begin, boxes never loaded, invalid slots) may hold
      // anything, NaN included; P is 0 there, and 0 x NaN is not. The attended rows are one range
      // [lo, hi), less the invalid slots where the slot array has holes.
      const int tile_begin = begin + tile * kTileKeys;
      int lo = 0;
      int hi = min(kTileKeys, end - tile_begin);
      if (keys.IsCompact(tile_begin)) {
        hi = min(hi, keys.compact_count - tile_begin);
      } else {
        lo = min(kTileKeys, max(0, keys.paged_valid_begin - keys.Position(tile_begin)));
      }
      hi = max(hi, lo);
      if (lo > 0 || hi < kTileKeys || slot_holes) {
        unsigned char* v_mutable = const_cast<unsigned char*>(v_tile);
        constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
        for (int i = threadIdx.x; i < kTileKeys * kChunks; i += kThreads) {
          const int r = i / kChunks;
          if (r >= lo && r < hi && (!slot_holes || keys.Attended(tile_begin + r))) continue;
          *reinterpret_cast<uint4*>(v_mutable + Tiles::Offset(r, i % kChunks)) =
              make_uint4(0, 0, 0, 0);
        }
        __syncthreads();
      }
    }
    if constexpr (Variant::kSlots) {
      // Each attended slot's ||v||_1 (a slot-scoring factor) from the V tile already here: two
      // threads a row, half the dims each, summed by a shuffle.
      constexpr int kHalfChunks = kHeadDim / 16;  // 16-byte chunks in half a row
      const int r = threadIdx.x / 2;
      const int index = begin + tile * kTileKeys + r;
      float norm = 0.f;
      for (int c = (threadIdx.x & 1) * kHalfChunks; c < ((threadIdx.x & 1) + 1) * kHalfChunks;
           ++c) {
        float v[8];
        LoadBf16x8(reinterpret_cast<const __nv_bfloat16*>(v_tile + Tiles::Offset(r, c)), v);
#pragma unroll
        for (int e = 0; e < 8; ++e) norm += fabsf(v[e]);
      }
      norm += __shfl_xor_sync(0xffffffffu, norm, 1);
      if ((threadIdx.x & 1) == 0 && index < end && (!slot_holes || keys.Attended(index))) {
        params.slot_value_norms[keys.slot_norm_row0 + index] = norm;
      }
    }
    const int warp_key0 = warp * kKeysPerWarp;  // this warp's first key row in the tile

    // S = Q K^T for the warp's keys: n-block j covers keys warp_key0 + 8j .. + 7.
    float score[kScoreBlocks][4];
#pragma unroll
    for (int j = 0; j < kScoreBlocks; ++j) {
      score[j][0] = score[j][1] = score[j][2] = score[j][3] = 0.f;
      const int key_row = warp_key0 + 8 * j + row;
#pragma unroll
      for (int s = 0; s < kHeadDim / 16; ++s) {
        const uint2 b = Tiles::KeyFragment(k_tile, key_row, s, quad);
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
        const bool attended =
            index < end && (Variant::kSlots && !slot_holes ? true : keys.Attended(index));
        const float x = attended ? score[j][e] * scale_log2 : -INFINITY;
        score[j][e] = x;
        tile_max = fmaxf(tile_max, x);
      }
    }
    if (Variant::kScores && row < kGroup) {  // raw scores (params.scores or probs)
      float* score_row =
          outputs.scores + (static_cast<size_t>(sequence) * params.num_heads + first_head + row) *
                               outputs.scores_stride;
      if (Variant::kSlots && outputs.slot_smem_slots > 0) {  // the block's own, index = slot
        const int near = outputs.slot_smem_slots;
#pragma unroll
        for (int j = 0; j < kScoreBlocks; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int index = index0 + 8 * j + 2 * quad + e;
            if (index < near) {
              shared_scores[row * near + index] = score[j][e];
            } else if (index < end) {
              score_row[index] = score[j][e];
            }
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kScoreBlocks; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int index = index0 + 8 * j + 2 * quad + e;
            if (index < end) score_row[keys.Position(index)] = score[j][e];  // no compact here
          }
        }
      }
    }
    // Scores only: the softmax statistics alone, and only when the launch wants the lse.
    if (!Variant::kValues && outputs.partial_lse == nullptr) continue;
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(row_max, tile_max);
    const float base = new_max == -INFINITY ? 0.f : new_max;  // all masked so far: no NaN
    const float correction = exp2f(row_max - base);
    row_max = new_max;
    row_sum *= correction;
    if constexpr (Variant::kValues) {
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; ++n) {
        out[n][0] *= correction;
        out[n][1] *= correction;
      }
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
    if constexpr (!Variant::kValues) continue;

    // O += P V, one k-step of 16 keys at a time: P as A fragments straight from the score
    // registers (keys 2q.. of n-block 2k are columns 2q.. of k-step k, n-block 2k+1's are
    // columns 8 + 2q..); V via ldmatrix.trans, matrices (keys +0..7 | +8..15) x (dims 8n | 8n+8).
    const int matrix = lane / 8;
#pragma unroll
    for (int k = 0; k < kKeySteps; ++k) {
      const uint32_t p_low = PackBf16x2(prob[2 * k][0], prob[2 * k][1]);
      const uint32_t p_high = PackBf16x2(prob[2 * k + 1][0], prob[2 * k + 1][1]);
      const int v_row = warp_key0 + 16 * k + (matrix & 1) * 8 + lane % 8;
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; n += 2) {
        uint32_t b0, b1, b0_next, b1_next;
        LdMatrixX4Trans(v_tile + Tiles::Offset(v_row, n + (matrix >> 1)), b0, b1, b0_next, b1_next);
        MmaRowsBelow8(out[n], p_low, p_high, b0, b1);
        MmaRowsBelow8(out[n + 1], p_low, p_high, b0_next, b1_next);
      }
    }
  }
  if (!Variant::kValues && outputs.partial_lse == nullptr) return;  // scores only, no lse
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
    if constexpr (Variant::kValues) {
      float* dest = warp_out + (warp * 8 + row) * kHeadDim;
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; ++n) {
        dest[8 * n + 2 * quad] = out[n][0];
        dest[8 * n + 2 * quad + 1] = out[n][1];
      }
    }
  }
  __syncthreads();
  // The split's lse of the group's head r (log2 units; -inf when nothing was attended).
  auto head_lse2 = [&](int r) {
    float block_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, warp_max[w * 8 + r]);
    const float base = block_max == -INFINITY ? 0.f : block_max;
    float denominator = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      denominator += exp2f(warp_max[w * 8 + r] - base) * warp_sum[w * 8 + r];
    return base + log2f(denominator);
  };
  if constexpr (!Variant::kValues) {  // scores only: the split's lse of each head, no output
    if (threadIdx.x < kGroup) {
      outputs.partial_lse[partial_row0 + static_cast<size_t>(threadIdx.x) * outputs.num_splits] =
          head_lse2(threadIdx.x);
    }
  } else {
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
  if constexpr (Variant::kSlots) {
    // One split saw every slot: its lse is the heads' own, and the eviction choice is made here
    // from the scores this block kept in shared memory (those past slot_smem_slots, and the
    // norms, in L2), with no second launch.
    if (outputs.num_splits == 1 && params.slot_next != nullptr) {
      float lse2[kGroup];
#pragma unroll
      for (int r = 0; r < kGroup; ++r) lse2[r] = head_lse2(r);
      __syncthreads();  // the block's score and norm writes are visible to all its threads
      SlotChoiceRow choice =
          SlotChoiceRowOf(params, outputs.scores, outputs.scores_stride, sequence, kv_head, kGroup);
      choice.near_scores = shared_scores;
      choice.near_count = outputs.slot_smem_slots;
      ChooseSlot<kGroup, kThreads>(choice, lse2);
    }
  }
}

}  // namespace rubato::cuda::decode_attention
