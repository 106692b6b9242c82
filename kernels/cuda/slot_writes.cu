// Writes into evicting KV slot arrays (slot_writes.cuh): kernels, launchers, validation. Pure
// copies in 16-byte pieces.
#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/slot_writes.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;

// grid.x covers num_kv_heads x head_dim / 8 pieces of one row; grid.y strides over the rows.
__global__ void __launch_bounds__(kThreads) WriteToNextSlotsKernel(const SlotWriteParams p) {
  const int pieces_per_head = p.head_dim / 8;
  const int piece = blockIdx.x * kThreads + threadIdx.x;
  if (piece >= p.num_kv_heads * pieces_per_head) return;
  const int kv_head = piece / pieces_per_head;
  const int column = (piece % pieces_per_head) * 8;
  for (int row = blockIdx.y; row < p.rows; row += gridDim.y) {
    const int array = p.arrays[row];
    if (array < 0 || array >= p.num_arrays) continue;
    const int slot = p.next_slot[static_cast<int64_t>(array) * p.num_kv_heads + kv_head];
    if (slot < 0 || slot >= p.budget) continue;
    const int64_t source = row * p.row_stride + static_cast<int64_t>(kv_head) * p.head_dim + column;
    const int64_t dest =
        ((static_cast<int64_t>(array) * p.num_kv_heads + kv_head) * p.budget + slot) * p.head_dim +
        column;
    *reinterpret_cast<uint4*>(p.slot_keys + dest) =
        *reinterpret_cast<const uint4*>(p.keys + source);
    *reinterpret_cast<uint4*>(p.slot_values + dest) =
        *reinterpret_cast<const uint4*>(p.values + source);
    if (column == 0) p.valid[static_cast<int64_t>(array) * p.budget + slot] = 1;
  }
}

// One block per row: its mask, then its next slots.
__global__ void __launch_bounds__(kThreads) MarkPromptSlotsKernel(const PromptSlotsParams p) {
  const int row = blockIdx.x;
  const int array = p.arrays[row];
  if (array < 0 || array >= p.num_arrays) return;
  const int kept = p.kept[row];
  uint8_t* valid = p.valid + static_cast<int64_t>(array) * p.budget;
  for (int i = threadIdx.x; i < p.budget; i += kThreads) valid[i] = i < kept ? 1 : 0;
  const int next = p.next[row];
  if (next < 0) return;
  for (int h = threadIdx.x; h < p.num_kv_heads; h += kThreads) {
    p.next_slot[static_cast<int64_t>(array) * p.num_kv_heads + h] = next;
  }
}

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

}  // namespace

Status WriteToNextSlots(const SlotWriteParams& p, cudaStream_t stream) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("WriteToNextSlots: " + what);
  };
  if (p.rows < 0) return invalid("rows = " + std::to_string(p.rows) + " must be >= 0");
  if (p.rows == 0) return Status::Ok();
  if (p.num_arrays < 1 || p.num_kv_heads < 1 || p.budget < 1 || p.head_dim < 8 ||
      p.head_dim % 8 != 0 || p.row_stride % 8 != 0) {
    return invalid("bad shape (arrays " + std::to_string(p.num_arrays) + ", KV heads " +
                   std::to_string(p.num_kv_heads) + ", budget " + std::to_string(p.budget) +
                   ", head_dim " + std::to_string(p.head_dim) + ", row stride " +
                   std::to_string(p.row_stride) + "; head_dim and row stride multiples of 8)");
  }
  if (p.keys == nullptr || p.values == nullptr || p.arrays == nullptr || p.slot_keys == nullptr ||
      p.slot_values == nullptr || p.valid == nullptr || p.next_slot == nullptr) {
    return invalid("a required pointer is null");
  }
  if (!Aligned16(p.keys) || !Aligned16(p.values) || !Aligned16(p.slot_keys) ||
      !Aligned16(p.slot_values)) {
    return invalid("the rows and the slot arrays must be 16-byte aligned");
  }
  const int pieces = p.num_kv_heads * (p.head_dim / 8);
  const dim3 grid(static_cast<unsigned>((pieces + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min(p.rows, kMaxGridY)));
  WriteToNextSlotsKernel<<<grid, kThreads, 0, stream>>>(p);
  return LaunchStatus("write_to_next_slots");
}

Status MarkPromptSlots(const PromptSlotsParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.rows > 65535) {
    return InvalidArgumentError("MarkPromptSlots: rows = " + std::to_string(p.rows) +
                                " outside [0, 65535]");
  }
  if (p.rows == 0) return Status::Ok();
  if (p.num_arrays < 1 || p.num_kv_heads < 1 || p.budget < 1) {
    return InvalidArgumentError("MarkPromptSlots: arrays, KV heads and budget must be >= 1");
  }
  if (p.arrays == nullptr || p.kept == nullptr || p.next == nullptr || p.valid == nullptr ||
      p.next_slot == nullptr) {
    return InvalidArgumentError("MarkPromptSlots: a required pointer is null");
  }
  MarkPromptSlotsKernel<<<p.rows, kThreads, 0, stream>>>(p);
  return LaunchStatus("mark_prompt_slots");
}

}  // namespace rubato::cuda
