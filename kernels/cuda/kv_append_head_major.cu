// Paged KV append from head-major rows (kv_append_head_major.cuh): a pure copy in 16-byte
// pieces; each thread moves one piece of K and the matching piece of V.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/kv_append_head_major.cuh"
#include "kernels/cuda/launch_checks.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // the kernel strides over the rest

// ---- kernel ----------------------------------------------------------------------------------

// The work is [rows][num_kv_heads][head_dim / 8] pieces, flattened.
__global__ void AppendHeadMajorKvKernel(const HeadMajorKvAppendParams p) {
  const int vectors_per_head = p.head_dim / 8;
  const int vectors_per_row = p.num_kv_heads * vectors_per_head;
  const int64_t total = static_cast<int64_t>(p.rows) * vectors_per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / vectors_per_row;
    const int32_t slot = p.slots[t];
    if (slot < 0) continue;
    const int in_row = static_cast<int>(v % vectors_per_row);
    const int head = in_row / vectors_per_head;
    const int column = (in_row % vectors_per_head) * 8;
    const int64_t from = static_cast<int64_t>(head) * p.head_strides[t] + column;
    const int64_t block = slot / p.block_tokens;
    const int row = slot % p.block_tokens;
    const int64_t dest =
        ((block * p.num_kv_heads + head) * p.block_tokens + row) * p.head_dim + column;
    *reinterpret_cast<uint4*>(p.key_pool + dest) =
        *reinterpret_cast<const uint4*>(p.source + p.key_offsets[t] + from);
    *reinterpret_cast<uint4*>(p.value_pool + dest) =
        *reinterpret_cast<const uint4*>(p.source + p.value_offsets[t] + from);
  }
}

Status Validate(const HeadMajorKvAppendParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status AppendHeadMajorKv(const HeadMajorKvAppendParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.rows == 0) return Status::Ok();
  const int64_t vectors =
      static_cast<int64_t>(params.rows) * params.num_kv_heads * (params.head_dim / 8);
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, kMaxBlocks);
  AppendHeadMajorKvKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  return LaunchStatus("append_head_major_kv");
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status Validate(const HeadMajorKvAppendParams& p) {
  const std::string op = "CUDA AppendHeadMajorKv: ";
  if (p.rows < 0) return InvalidArgumentError(op + "rows " + std::to_string(p.rows) + " < 0");
  if (p.rows == 0) return Status::Ok();
  if (p.num_kv_heads < 1) {
    return InvalidArgumentError(op + "num_kv_heads " + std::to_string(p.num_kv_heads) + " < 1");
  }
  if (p.head_dim < 8 || p.head_dim % 8 != 0) {
    return InvalidArgumentError(op + "head_dim " + std::to_string(p.head_dim) +
                                " must be a positive multiple of 8");
  }
  if (p.block_tokens < 1) {
    return InvalidArgumentError(op + "block_tokens " + std::to_string(p.block_tokens) + " < 1");
  }
  if (p.source == nullptr) return InvalidArgumentError(op + "source is null");
  if (p.key_offsets == nullptr) return InvalidArgumentError(op + "key_offsets is null");
  if (p.value_offsets == nullptr) return InvalidArgumentError(op + "value_offsets is null");
  if (p.head_strides == nullptr) return InvalidArgumentError(op + "head_strides is null");
  if (p.slots == nullptr) return InvalidArgumentError(op + "slots is null");
  if (p.key_pool == nullptr) return InvalidArgumentError(op + "key_pool is null");
  if (p.value_pool == nullptr) return InvalidArgumentError(op + "value_pool is null");
  if (!Aligned16(p.source) || !Aligned16(p.key_pool) || !Aligned16(p.value_pool)) {
    return InvalidArgumentError(op + "source, key_pool and value_pool must be 16-byte aligned");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
