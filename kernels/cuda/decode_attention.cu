// Dense decode attention (decode_attention.cuh): split-K flash-decoding over a paged bf16 KV
// cache, GQA-aware, on tensor cores. The split kernel (decode_attention_split.cuh) computes a
// partial softmax per range of keys; the merge kernel here weights the ranges by their
// log-sum-exp; an optional third kernel turns the raw scores into GQA-pooled probabilities.
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/decode_attention_split.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/tensor_map.h"

namespace rubato::cuda {
namespace {

using namespace decode_attention;  // the split kernel and its constants

// ---- merge kernels --------------------------------------------------------------------------

// One block per (sequence, head): weights the splits by exp2(lse_s - max) and writes the bf16
// output, the natural-log LSE and the log2 LSE the probabilities kernel needs.
template <int kHeadDim>
__global__ void __launch_bounds__(128)
    DecodeAttentionMergeKernel(const DecodeAttentionParams params, const SplitOutputs outputs) {
  extern __shared__ float split_weight[];  // [num_splits]
  __shared__ float reduce[32];
  WaitForPriorGrids();
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
  for (int d = threadIdx.x; d < kHeadDim && !params.scores_only; d += blockDim.x) {
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
      mean += exp2f(outputs.scores[row * outputs.scores_stride + position] - outputs.lse2[row]);
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

// Scores-only launches keep no partial outputs (head_dim 0 here): only the lse partials.
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
template <int kHeadDim, int kGroup, bool kTensorCopies, class Variant>
Status AllowSplitKernelSharedMemory(int bytes) {
  static std::array<std::atomic<bool>, kMaxCachedDevices> raised{};
  const int device = CurrentDevice();
  if (device < kMaxCachedDevices && raised[device].load(std::memory_order_acquire)) {
    return Status::Ok();
  }
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(DecodeAttentionSplitKernel<kHeadDim, kGroup, kTensorCopies, Variant>,
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

// Rows of the compact arrays: [buffers][num_kv_heads][capacity], one buffer per sequence or per
// pool slot (compact_slots).
int64_t CompactRows(const DecodeAttentionParams& params) {
  const int64_t buffers = params.compact_slots != nullptr ? params.num_compact_slots : params.batch;
  return buffers * params.num_kv_heads * params.compact_capacity;
}

// Whole-block tensor copies (decode_attention_split.cuh) apply when the pools' size is known,
// every visible key sits at its own position (the window hides nothing below max_seq_len), the
// rows fit 32-bit tile coordinates, and head_dim is a multiple of the 64-dim box.
bool UsesTensorCopies(const DecodeAttentionParams& params) {
  const long long window_keys = static_cast<long long>(params.sink_tokens) + params.recent_tokens;
  const long long pool_rows =
      static_cast<long long>(params.num_pool_blocks) * params.num_kv_heads * params.block_tokens;
  const long long compact_rows = CompactRows(params);
  return (params.head_dim == 64 || params.head_dim == 128) && params.num_pool_blocks > 0 &&
         window_keys >= params.max_seq_len && pool_rows <= INT_MAX && compact_rows <= INT_MAX;
}

// Rows of the slot arrays: [arrays][num_kv_heads][slot_budget].
int64_t SlotRows(const DecodeAttentionParams& params) {
  const int64_t arrays = params.slot_arrays != nullptr ? params.num_slot_arrays : params.batch;
  return arrays * params.num_kv_heads * params.slot_budget;
}

// Slot launches copy whole tiles through tensor maps over the slot arrays' rows when head_dim is
// a multiple of the 64-dim box and the rows fit 32-bit tile coordinates.
bool SlotsUseTensorCopies(const DecodeAttentionParams& params) {
  return (params.head_dim == 64 || params.head_dim == 128) && SlotRows(params) <= INT_MAX;
}

// The bound of key indices a launch sizes its workspace for: the list capacity of index-gather
// launches, else max_seq_len.
int KeyBound(const DecodeAttentionParams& params) {
  if (params.slot_keys != nullptr) return params.slot_budget;
  return params.lists != nullptr ? params.list_capacity : params.max_seq_len;
}

// The largest key index count of any (sequence, KV head) (decode_attention_split.cuh KeySpace):
// the list's capacity, the window's keys, or for two-segment launches the compact rows rounded up
// to a tile plus the paged keys from recent_begin rounded down to a tile.
int MaxKeys(const DecodeAttentionParams& params) {
  if (params.slot_keys != nullptr) return params.slot_budget;
  if (params.lists != nullptr) return params.list_capacity;
  if (params.compact_keys == nullptr) {
    const long long window_keys = static_cast<long long>(params.sink_tokens) + params.recent_tokens;
    return static_cast<int>(std::min<long long>(params.max_seq_len, window_keys));
  }
  const auto round_up = [](long long n) { return (n + kTileKeys - 1) / kTileKeys * kTileKeys; };
  const long long recent = std::min(params.max_seq_len, params.max_recent_tokens);
  return static_cast<int>(round_up(params.compact_capacity) + recent + kTileKeys - 1);
}

template <int kHeadDim, int kGroup, bool kTensorCopies, class Variant>
Status LaunchSplits(const DecodeAttentionParams& params, const SplitOutputs& outputs,
                    cudaStream_t stream) {
  constexpr int kTileSmem = TilesFor<kHeadDim, kTensorCopies>::kSmemBytes;
  constexpr int kMostSmem = kTileSmem + (Variant::kSlots ? kSlotChoiceSmemBytes : 0);
  RUBATO_RETURN_IF_ERROR(
      (AllowSplitKernelSharedMemory<kHeadDim, kGroup, kTensorCopies, Variant>(kMostSmem)));
  const bool in_block_choice =
      Variant::kSlots && outputs.num_splits == 1 && params.slot_next != nullptr;
  const int smem = in_block_choice ? kMostSmem : kTileSmem;
  CUtensorMap key_map{}, value_map{}, compact_key_map{}, compact_value_map{};
  if constexpr (kTensorCopies && !Variant::kSlots) {
    const Bf16RowsMapShape shape{
        static_cast<int64_t>(params.num_pool_blocks) * params.num_kv_heads * params.block_tokens,
        kHeadDim, 64, params.block_tokens};
    RUBATO_RETURN_IF_ERROR(EncodeBf16RowsMap(params.key_pool, shape, key_map));
    if constexpr (Variant::kValues) {  // a scores-only launch has no value pool
      RUBATO_RETURN_IF_ERROR(EncodeBf16RowsMap(params.value_pool, shape, value_map));
    }
    if constexpr (Variant::kCompact) {
      const Bf16RowsMapShape compact{CompactRows(params), kHeadDim, 64, params.block_tokens};
      RUBATO_RETURN_IF_ERROR(EncodeBf16RowsMap(params.compact_keys, compact, compact_key_map));
      RUBATO_RETURN_IF_ERROR(EncodeBf16RowsMap(params.compact_values, compact, compact_value_map));
    }
  }
  if constexpr (kTensorCopies && Variant::kSlots) {  // the slot arrays, in place of the pools
    const Bf16RowsMapShape slots{SlotRows(params), kHeadDim, 64, kTileKeys};
    RUBATO_RETURN_IF_ERROR(EncodeBf16RowsMap(params.slot_keys, slots, compact_key_map));
    RUBATO_RETURN_IF_ERROR(EncodeBf16RowsMap(params.slot_values, slots, compact_value_map));
  }
  const dim3 grid(outputs.num_splits, params.num_kv_heads, params.batch);
  LaunchPdl(DecodeAttentionSplitKernel<kHeadDim, kGroup, kTensorCopies, Variant>, grid,
            dim3(kThreads), smem, stream, params, outputs, key_map, value_map, compact_key_map,
            compact_value_map);
  return LaunchStatus("decode_attention_split");
}

// The one place a launch's variant is chosen (decode_attention_split.cuh): a list of positions,
// a compact segment, scores alone, else raw scores to write beside the output (the caller's, or
// the probabilities' input), else the window alone.
template <int kHeadDim, int kGroup, bool kTensorCopies>
Status LaunchVariant(const DecodeAttentionParams& params, const SplitOutputs& outputs,
                     cudaStream_t stream) {
  if (params.slot_keys != nullptr) {
    return LaunchSplits<kHeadDim, kGroup, kTensorCopies, SlotsVariant>(params, outputs, stream);
  }
  if constexpr (!kTensorCopies) {
    if (params.lists != nullptr) {
      return LaunchSplits<kHeadDim, kGroup, false, ListVariant>(params, outputs, stream);
    }
  }
  if (params.scores_only) {
    return LaunchSplits<kHeadDim, kGroup, kTensorCopies, ScoresOnlyVariant>(params, outputs,
                                                                            stream);
  }
  if (params.compact_keys != nullptr) {
    return LaunchSplits<kHeadDim, kGroup, kTensorCopies, TwoSegmentVariant>(params, outputs,
                                                                            stream);
  }
  if (outputs.scores != nullptr) {
    return LaunchSplits<kHeadDim, kGroup, kTensorCopies, WindowScoresVariant>(params, outputs,
                                                                              stream);
  }
  return LaunchSplits<kHeadDim, kGroup, kTensorCopies, WindowVariant>(params, outputs, stream);
}

template <int kHeadDim, int kGroup>
Status Launch(const DecodeAttentionParams& params, const WorkspaceLayout& layout,
              cudaStream_t stream) {
  const int max_visible = MaxKeys(params);
  const bool tensor_copies = params.slot_keys != nullptr
                                 ? SlotsUseTensorCopies(params)
                                 : params.lists == nullptr && UsesTensorCopies(params);
  SplitOutputs outputs;
  int splits = params.num_splits > 0
                   ? params.num_splits
                   : ChooseSplits(params.batch * params.num_kv_heads, max_visible);
  splits = std::min(splits, MaxSplits(KeyBound(params)));  // what the workspace holds
  outputs.keys_per_split = (max_visible + splits - 1) / splits;
  if (tensor_copies) {  // ranges of whole tiles, so that tiles start on block boundaries
    outputs.keys_per_split = (outputs.keys_per_split + kTileKeys - 1) / kTileKeys * kTileKeys;
  }
  outputs.num_splits = (max_visible + outputs.keys_per_split - 1) / outputs.keys_per_split;
  unsigned char* workspace = static_cast<unsigned char*>(params.workspace);
  // One split making the choice in its block: the scores of as many leading slots as fit stay in
  // shared memory (all, or a multiple of 4: the choice reads them four at a time).
  if (params.slot_keys != nullptr && params.slot_next != nullptr && outputs.num_splits == 1) {
    constexpr int kFit = kSlotChoiceSmemBytes / (kGroup * static_cast<int>(sizeof(float)));
    outputs.slot_smem_slots = params.slot_budget <= kFit ? params.slot_budget : kFit / 4 * 4;
  }
  if (params.scores_only) {  // the scores; with lse wanted each split's lse and the merge
    outputs.scores = params.scores;
    outputs.scores_stride = params.scores_stride;
    if (params.lse != nullptr) {
      outputs.partial_lse = reinterpret_cast<float*>(workspace + layout.partial_lse);
      outputs.lse2 = reinterpret_cast<float*>(workspace + layout.lse2);
    }
  } else {
    outputs.partial_out = reinterpret_cast<float*>(workspace + layout.partial_out);
    outputs.partial_lse = reinterpret_cast<float*>(workspace + layout.partial_lse);
    outputs.lse2 = reinterpret_cast<float*>(workspace + layout.lse2);
    if (params.scores != nullptr) {  // the caller's (the probabilities kernel reads them too)
      outputs.scores = params.scores;
      outputs.scores_stride = params.scores_stride;
    } else if (params.kv_head_probs != nullptr) {
      outputs.scores = reinterpret_cast<float*>(workspace + layout.scores);
      outputs.scores_stride = params.max_seq_len;
    }
  }

  if constexpr (kHeadDim % 64 == 0) {
    if (tensor_copies) {
      RUBATO_RETURN_IF_ERROR((LaunchVariant<kHeadDim, kGroup, true>(params, outputs, stream)));
    } else {
      RUBATO_RETURN_IF_ERROR((LaunchVariant<kHeadDim, kGroup, false>(params, outputs, stream)));
    }
  } else {
    RUBATO_RETURN_IF_ERROR((LaunchVariant<kHeadDim, kGroup, false>(params, outputs, stream)));
  }
  if (params.scores_only && params.lse == nullptr) return Status::Ok();

  // The merge: the output and the lse (a scores-only launch: the lse alone).
  LaunchPdl(DecodeAttentionMergeKernel<kHeadDim>,
            dim3(static_cast<unsigned>(params.batch * params.num_heads)), dim3(128),
            MergeSharedBytes(outputs.num_splits), stream, params, outputs);
  RUBATO_RETURN_IF_ERROR(LaunchStatus("decode_attention_merge"));

  if (params.kv_head_probs != nullptr) {
    constexpr int kProbThreads = 256;
    const dim3 probs_grid((params.max_seq_len + kProbThreads - 1) / kProbThreads,
                          params.num_kv_heads, params.batch);
    DecodeAttentionProbsKernel<kGroup><<<probs_grid, kProbThreads, 0, stream>>>(params, outputs);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("decode_attention_probs"));
  }
  if (params.slot_next != nullptr && outputs.num_splits > 1) {  // one split chose in its block
    SlotChoiceKernel<kGroup><<<dim3(params.num_kv_heads, params.batch), 256, 0, stream>>>(
        params, outputs.scores, outputs.scores_stride, outputs.lse2);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("decode_attention_slot_choice"));
  }
  return Status::Ok();
}

// A slot launch: the slot arrays instead of the paged pool, no window or extras.
Status ValidateSlots(const DecodeAttentionParams& p) {
  auto invalid = [](const std::string& what) {
    return InvalidArgumentError("decode attention over slots: " + what);
  };
  if (p.q == nullptr || p.slot_values == nullptr || p.slot_valid == nullptr || p.out == nullptr ||
      p.scores == nullptr || p.slot_value_norms == nullptr) {
    return invalid("q, slot_values, slot_valid, out, scores and slot_value_norms must be set");
  }
  if (p.batch < 1 || p.num_kv_heads < 1 || p.num_heads < 1 || p.num_heads % p.num_kv_heads != 0 ||
      p.slot_budget < 1) {
    return invalid("bad shape (batch " + std::to_string(p.batch) + ", heads " +
                   std::to_string(p.num_heads) + "/" + std::to_string(p.num_kv_heads) +
                   ", slot_budget " + std::to_string(p.slot_budget) + ")");
  }
  if (p.lists != nullptr || p.compact_keys != nullptr || p.kv_head_probs != nullptr ||
      p.scores_only || p.sink_tokens != 0 || p.recent_tokens != INT_MAX) {
    return invalid("takes no list, compact segment, probabilities, window or scores-only pass");
  }
  if (p.slot_arrays != nullptr && p.num_slot_arrays < 1) {
    return invalid("num_slot_arrays must be >= 1 with slot_arrays, got " +
                   std::to_string(p.num_slot_arrays));
  }
  if (p.slot_sink_slots < 0 || p.slot_sink_slots > p.slot_budget) {
    return invalid("slot_sink_slots " + std::to_string(p.slot_sink_slots) + " outside [0, " +
                   std::to_string(p.slot_budget) + "]");
  }
  if (p.scores_stride < p.slot_budget || p.max_seq_len != p.slot_budget) {
    return invalid("scores_stride and max_seq_len must hold slot_budget " +
                   std::to_string(p.slot_budget));
  }
  if (std::isnan(p.scale) || std::isinf(p.scale)) return invalid("scale is not finite");
  if (!Aligned16(p.q) || !Aligned16(p.slot_keys) || !Aligned16(p.slot_values) ||
      p.q_row_stride % 8 != 0 || p.q_row_stride < static_cast<int64_t>(p.num_heads) * p.head_dim ||
      p.out_row_stride < static_cast<int64_t>(p.num_heads) * p.head_dim) {
    return invalid("q and the slots must be 16-byte aligned, the row strides hold every head");
  }
  const size_t needed =
      DecodeAttentionWorkspaceBytes(p.batch, p.num_heads, p.head_dim, p.slot_budget, false);
  if (p.workspace == nullptr || p.workspace_bytes < needed) {
    return invalid("workspace of " + std::to_string(p.workspace_bytes) + " bytes; " +
                   std::to_string(needed) + " needed (DecodeAttentionWorkspaceBytes)");
  }
  return Status::Ok();
}

Status Validate(const DecodeAttentionParams& p) {
  auto invalid = [](const std::string& what) {
    return InvalidArgumentError("decode attention: " + what);
  };
  if (p.slot_keys != nullptr) return ValidateSlots(p);
  if (p.slot_next != nullptr || p.slot_choice_scores != nullptr || p.slot_used_max != nullptr) {
    return invalid("slot_next, slot_choice_scores and slot_used_max need slot arrays");
  }
  if (p.q == nullptr || p.key_pool == nullptr || p.block_tables == nullptr) {
    return invalid("q, key_pool and block_tables must be set");
  }
  if (!p.scores_only && (p.value_pool == nullptr || p.out == nullptr)) {
    return invalid("value_pool and out must be set (only a scores-only launch goes without)");
  }
  if (p.lists == nullptr && p.seq_lens == nullptr) {
    return invalid("seq_lens must be set (only an index-gather launch goes without)");
  }
  if (p.batch < 1) return invalid("batch " + std::to_string(p.batch) + " < 1");
  if (p.num_kv_heads < 1 || p.num_heads < 1 || p.num_heads % p.num_kv_heads != 0) {
    return invalid("num_heads " + std::to_string(p.num_heads) + " is not a positive multiple of " +
                   "num_kv_heads " + std::to_string(p.num_kv_heads));
  }
  if (p.num_pool_blocks < 0) {
    return invalid("num_pool_blocks " + std::to_string(p.num_pool_blocks) + " < 0");
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
  if (std::isnan(p.scale) || std::isinf(p.scale)) return invalid("scale is not finite");
  if (!Aligned16(p.q) || !Aligned16(p.key_pool) || !Aligned16(p.value_pool) ||
      p.q_row_stride % 8 != 0) {  // Aligned16(nullptr) holds
    return invalid(
        "q, key_pool and value_pool must be 16-byte aligned, q_row_stride a multiple of 8");
  }
  if (p.q_row_stride < static_cast<int64_t>(p.num_heads) * p.head_dim ||
      (!p.scores_only && p.out_row_stride < static_cast<int64_t>(p.num_heads) * p.head_dim)) {
    return invalid("q_row_stride / out_row_stride smaller than num_heads * head_dim");
  }
  if (p.compact_keys != nullptr) {
    if (p.compact_values == nullptr || p.compact_counts == nullptr || p.recent_begin == nullptr) {
      return invalid("a compact segment needs compact_values, compact_counts and recent_begin");
    }
    if (!Aligned16(p.compact_keys) || !Aligned16(p.compact_values)) {
      return invalid("compact_keys and compact_values must be 16-byte aligned");
    }
    if (p.compact_capacity < 1 || p.max_recent_tokens < 1) {
      return invalid("compact_capacity " + std::to_string(p.compact_capacity) +
                     " and max_recent_tokens " + std::to_string(p.max_recent_tokens) +
                     " must be >= 1");
    }
    if (p.sink_tokens != 0 || p.recent_tokens != INT_MAX || p.kv_head_probs != nullptr ||
        p.scores != nullptr) {
      return invalid("a compact segment needs a dense window and no kv_head_probs or scores");
    }
    if (p.compact_slots != nullptr && p.num_compact_slots < 1) {
      return invalid("compact_slots needs num_compact_slots >= 1, got " +
                     std::to_string(p.num_compact_slots));
    }
  }
  if (p.lists != nullptr) {
    if (p.list_counts == nullptr || p.list_capacity < 1 || p.list_heads < 1) {
      return invalid("an index-gather launch needs list_counts, list_capacity >= 1 and " +
                     std::string("list_heads >= 1 (got capacity ") +
                     std::to_string(p.list_capacity) + ", list heads " +
                     std::to_string(p.list_heads) + ")");
    }
    if (p.compact_keys != nullptr || p.scores != nullptr || p.kv_head_probs != nullptr ||
        p.scores_only || p.sink_tokens != 0 || p.recent_tokens != INT_MAX) {
      return invalid("an index-gather launch takes no compact segment, window, scores or probs");
    }
  }
  if (p.scores_only) {
    if (p.scores == nullptr || p.compact_keys != nullptr || p.kv_head_probs != nullptr) {
      return invalid("a scores-only launch needs scores and takes no compact segment or probs");
    }
    if (p.scores_stride < p.max_seq_len) {
      return invalid("scores_stride " + std::to_string(p.scores_stride) + " < max_seq_len " +
                     std::to_string(p.max_seq_len));
    }
    if (p.lse == nullptr) return Status::Ok();  // no workspace
    const size_t needed = DecodeScoresOnlyWorkspaceBytes(p.batch, p.num_heads, p.max_seq_len);
    if (p.workspace == nullptr || p.workspace_bytes < needed) {
      return invalid("workspace of " + std::to_string(p.workspace_bytes) + " bytes; " +
                     std::to_string(needed) + " needed (DecodeScoresOnlyWorkspaceBytes)");
    }
    return Status::Ok();
  }
  if (p.scores != nullptr && p.scores_stride < p.max_seq_len) {
    return invalid("scores_stride " + std::to_string(p.scores_stride) + " < max_seq_len " +
                   std::to_string(p.max_seq_len));
  }
  if (p.kv_head_probs != nullptr && p.probs_stride < p.max_seq_len) {
    return invalid("probs_stride " + std::to_string(p.probs_stride) + " < max_seq_len " +
                   std::to_string(p.max_seq_len));
  }
  const size_t needed = DecodeAttentionWorkspaceBytes(p.batch, p.num_heads, p.head_dim, KeyBound(p),
                                                      p.kv_head_probs != nullptr);
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

size_t DecodeScoresOnlyWorkspaceBytes(int batch, int num_heads, int max_seq_len) {
  if (batch < 1 || num_heads < 1 || max_seq_len < 1) return 0;
  return LayoutWorkspace(batch, num_heads, 0, max_seq_len, false).total;
}

int DecodeAttentionDefaultSplits(int batch, int num_kv_heads, int max_seq_len) {
  if (batch < 1 || num_kv_heads < 1 || max_seq_len < 1) return 1;
  // Launch's choice for a dense launch: its visible keys and its key bound are max_seq_len.
  return std::min(ChooseSplits(batch * num_kv_heads, max_seq_len), MaxSplits(max_seq_len));
}

Status DecodeAttention(const DecodeAttentionParams& params, cudaStream_t stream) {
  RUBATO_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, {
    RUBATO_RETURN_IF_ERROR(Validate(params));
    const WorkspaceLayout layout =
        LayoutWorkspace(params.batch, params.num_heads, params.scores_only ? 0 : kHeadDim,
                        KeyBound(params), params.kv_head_probs != nullptr);
    const int group = params.num_heads / params.num_kv_heads;
    RUBATO_DISPATCH_GQA_GROUP(group, kGroup,
                              { return Launch<kHeadDim, kGroup>(params, layout, stream); });
  });
}

}  // namespace rubato::cuda
