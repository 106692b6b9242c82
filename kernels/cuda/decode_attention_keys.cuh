// The decode attention split kernel's constants and key spaces (decode_attention_split.cuh):
// which keys a (sequence, KV head) attends and in what order, for each compile-time variant of
// a launch (a window, a compact segment then paged keys, a list of positions, a slot array).
// docs/decode_attention.md.
#pragma once

#include <cstdint>

#include "kernels/cuda/decode_attention.cuh"

namespace rubato::cuda::decode_attention {
#ifndef RUBATO_DECODE_TILE_KEYS  // build-time knobs for benchmark sweeps only
#define RUBATO_DECODE_TILE_KEYS 64
#define RUBATO_DECODE_STAGES 2
#define RUBATO_DECODE_BLOCKS_PER_SM 2
#endif
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = RUBATO_DECODE_TILE_KEYS;  // keys per pipeline stage
constexpr int kKeysPerWarp = kTileKeys / kWarps;    // a multiple of 16 (P V k-steps)
constexpr int kKeySteps = kKeysPerWarp / 16;        // P V k-steps per warp and tile
constexpr int kScoreBlocks = kKeysPerWarp / 8;      // S n-blocks per warp and tile
// Tiles per block: one in flight while one is read. A third stage measured 1.5-3 % slower at
// 16 x 128K for both copy kinds (more bytes in flight than HBM serves best).
constexpr int kStages = RUBATO_DECODE_STAGES;
static_assert(kKeysPerWarp % 16 == 0, "warps take whole P V k-steps");
static_assert(kThreads == 2 * kTileKeys, "row copies: one K or V row per thread");
constexpr int kMinKeysPerSplit = 256;  // bounds the split count (and the workspace)
constexpr int kBlocksPerSm = RUBATO_DECODE_BLOCKS_PER_SM;  // what the shared memory allows
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

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

// What a launch adds to windowed attention, fixed at compile time (the launcher picks one from
// the params, decode_attention.cu): whether keys start with a compact segment or come from a
// list of positions, whether raw scores are written, and whether values are read at all (a
// scores-only pass). Each variant is the key space below plus flags; the kernel is one.
struct WindowVariant {  // the window's keys; no scores
  static constexpr bool kCompact = false;
  static constexpr bool kList = false;
  static constexpr bool kSlots = false;
  static constexpr bool kScores = false;
  static constexpr bool kValues = true;
};
struct WindowScoresVariant {  // the window's keys; raw scores (the caller's, or for probs)
  static constexpr bool kCompact = false;
  static constexpr bool kList = false;
  static constexpr bool kSlots = false;
  static constexpr bool kScores = true;
  static constexpr bool kValues = true;
};
struct ScoresOnlyVariant {  // the window's keys; raw scores, no values, no output
  static constexpr bool kCompact = false;
  static constexpr bool kList = false;
  static constexpr bool kSlots = false;
  static constexpr bool kScores = true;
  static constexpr bool kValues = false;
};
struct TwoSegmentVariant {  // compact rows, then the paged keys from recent_begin
  static constexpr bool kCompact = true;
  static constexpr bool kList = false;
  static constexpr bool kSlots = false;
  static constexpr bool kScores = false;
  static constexpr bool kValues = true;
};
struct ListVariant {  // the positions of a list (index gather)
  static constexpr bool kCompact = false;
  static constexpr bool kList = true;
  static constexpr bool kSlots = false;
  static constexpr bool kScores = false;
  static constexpr bool kValues = true;
};
struct SlotsVariant {  // the valid rows of a slot array; raw scores and ||v||_1
  static constexpr bool kCompact = false;
  static constexpr bool kList = false;
  static constexpr bool kSlots = true;
  static constexpr bool kScores = true;
  static constexpr bool kValues = true;
};

// A (sequence, KV head)'s keys as the split kernel numbers them, index 0..count-1:
//   * [0, compact_end): compact rows (kCompact only); row i is attended iff i < compact_count;
//     compact_end rounds compact_count up to a tile, so that the paged keys start on a tile
//     boundary;
//   * [compact_end, count): paged positions paged.Position(i - compact_end), attended iff
//     >= paged_valid_begin. Two-segment launches start the paged keys at recent_begin rounded
//     down to a tile (tiles of whole blocks for tensor copies) and mask the positions below it;
//     window launches attend every index (the window already skipped the hidden keys);
//   * list launches (kList): index i is the position list[i], every index < count attended;
//   * slot launches (kSlots): index i is row i of the (sequence, KV head)'s slot array, attended
//     where valid.
template <bool kCompact, bool kList = false, bool kSlots = false>
struct KeySpace {
  VisibleKeys paged;
  const int32_t* list = nullptr;
  const uint8_t* slot_valid = nullptr;  // the sequence's [slot_budget]
  int64_t slot_row0 = 0;                // first row of the (sequence, KV head)'s slot array
  int64_t slot_norm_row0 = 0;           // first ||v||_1 of the (sequence, KV head)
  int64_t compact_row0 = 0;             // first compact row of the (sequence's slot, KV head)
  int compact_count = 0;
  int compact_end = 0;
  int paged_valid_begin = 0;
  int count = 0;
  __device__ bool IsCompact(int index) const { return kCompact && index < compact_end; }
  __device__ int Position(int index) const {
    if constexpr (kList) return list[index];
    if constexpr (kSlots) return index;
    return paged.Position(kCompact ? index - compact_end : index);
  }
  __device__ bool Attended(int index) const {
    if constexpr (kSlots) return slot_valid[index] != 0;
    if constexpr (!kCompact) return true;
    return index < compact_end ? index < compact_count : Position(index) >= paged_valid_begin;
  }
};

template <class Variant>
using KeySpaceFor = KeySpace<Variant::kCompact, Variant::kList, Variant::kSlots>;

// The slot array of a slot launch's sequence: its own index, or its array in a pool
// (slot_arrays, clamped to [0, num_slot_arrays)).
__device__ inline int SlotArrayOf(const DecodeAttentionParams& params, int sequence) {
  return params.slot_arrays == nullptr
             ? sequence
             : min(max(params.slot_arrays[sequence], 0), params.num_slot_arrays - 1);
}

template <class Variant>
__device__ inline KeySpaceFor<Variant> KeySpaceOf(const DecodeAttentionParams& params, int sequence,
                                                  int kv_head, int seq_len) {
  KeySpaceFor<Variant> keys;
  if constexpr (Variant::kSlots) {
    const int array = SlotArrayOf(params, sequence);
    keys.slot_valid = params.slot_valid + static_cast<int64_t>(array) * params.slot_budget;
    keys.slot_row0 =
        (static_cast<int64_t>(array) * params.num_kv_heads + kv_head) * params.slot_budget;
    keys.slot_norm_row0 =
        (static_cast<int64_t>(sequence) * params.num_kv_heads + kv_head) * params.slot_budget;
    keys.count = params.slot_budget;
    return keys;
  } else if constexpr (Variant::kList) {
    const int list_head = params.list_head_map != nullptr ? params.list_head_map[kv_head] : kv_head;
    const int64_t row = static_cast<int64_t>(sequence) * params.list_heads + list_head;
    keys.list = params.lists + row * params.list_capacity;
    keys.count = min(max(params.list_counts[row], 0), params.list_capacity);
    return keys;
  } else if constexpr (!Variant::kCompact) {
    keys.paged = VisibleKeysOf(seq_len, params.sink_tokens, params.recent_tokens);
    keys.count = keys.paged.count;
    return keys;
  } else {
    // The sequence's compact buffer: its own index, or its slot in a pool (compact_slots).
    const int compact_index =
        params.compact_slots == nullptr
            ? sequence
            : min(max(params.compact_slots[sequence], 0), params.num_compact_slots - 1);
    const int64_t compact_pair =
        static_cast<int64_t>(compact_index) * params.num_kv_heads + kv_head;
    keys.compact_row0 = compact_pair * params.compact_capacity;
    keys.compact_count = min(max(params.compact_counts[compact_pair], 0), params.compact_capacity);
    keys.compact_end = (keys.compact_count + kTileKeys - 1) / kTileKeys * kTileKeys;
    keys.paged_valid_begin = min(max(params.recent_begin[sequence], 0), seq_len);
    const int paged_begin = keys.paged_valid_begin / kTileKeys * kTileKeys;
    keys.paged = VisibleKeys{0, paged_begin, seq_len - paged_begin};
    keys.count = keys.compact_end + keys.paged.count;
    return keys;
  }
}

}  // namespace rubato::cuda::decode_attention
