// Writes into evicting KV slot arrays (docs/design.md §3 "KV residency"), on the device so that a
// decode step stays graph-replayable: each decode token's K/V go into the slot its array's
// next_slot names (marking it valid), and after a prompt moved into the slots (compact_gather.cuh
// with the arrays as its pool) the masks and next slots are set. CPU twin of the token write:
// inference_rank/kv/slot_kv_pool.h WriteToNextSlots (same contract, bf16 here).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct SlotWriteParams {
  // Row r's K head h at keys + r * row_stride + h * head_dim (likewise values), bf16: the fused
  // qkv rows after RoPE.
  const __nv_bfloat16* keys = nullptr;
  const __nv_bfloat16* values = nullptr;
  int64_t row_stride = 0;           // elements, a multiple of 8
  const int32_t* arrays = nullptr;  // [rows], device: row r writes slot array arrays[r]
  int rows = 0;                     // >= 0; 0 is a no-op
  int num_arrays = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // a multiple of 8
  int budget = 0;
  __nv_bfloat16* slot_keys = nullptr;    // [num_arrays][num_kv_heads][budget][head_dim]
  __nv_bfloat16* slot_values = nullptr;  // [num_arrays][num_kv_heads][budget][head_dim]
  uint8_t* valid = nullptr;              // [num_arrays][budget]: set where written
  const int32_t* next_slot = nullptr;    // [num_arrays][num_kv_heads]: where each head writes
};

// A row whose array or next slot lies outside its range (a caller bug, or -1: no slot may be
// written) writes nothing. Never synchronizes.
Status WriteToNextSlots(const SlotWriteParams& params, cudaStream_t stream);

struct PromptSlotsParams {
  const int32_t* arrays = nullptr;  // [rows], device
  const int32_t* kept = nullptr;    // [rows], device: slots [0, kept) valid, the rest not
  // [rows], device: every KV head's next slot, or -1 to leave next_slot as it is (a later op
  // chooses it).
  const int32_t* next = nullptr;
  int rows = 0;
  int num_arrays = 0;
  int num_kv_heads = 0;
  int budget = 0;
  uint8_t* valid = nullptr;      // [num_arrays][budget]
  int32_t* next_slot = nullptr;  // [num_arrays][num_kv_heads]
};

Status MarkPromptSlots(const PromptSlotsParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
