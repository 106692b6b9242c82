// Paged KV append on the GPU (kv_append.cuh): copies the new tokens' K and V heads out of the
// fused qkv projection into their slots of the paged pools. A pure copy in 16-byte pieces; each
// thread moves one piece of K and the matching piece of V.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/kv_append.cuh"
#include "kernels/cuda/launch_checks.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
// The grid is capped and the kernel strides over the rest (see embedding.cu).
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// ---- kernel ----------------------------------------------------------------------------------

// The work is [tokens][num_kv_heads][head_dim / 8] pieces, flattened: a warp copies 512
// contiguous bytes of source rows into whole [head_dim] rows of the pool slabs.
__global__ void AppendToPagedKvKernel(KvAppendParams p) {
  const int vectors_per_head = p.head_dim / 8;
  const int vectors_per_token = p.num_kv_heads * vectors_per_head;
  const int64_t total = static_cast<int64_t>(p.tokens) * vectors_per_token;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = v / vectors_per_token;
    const int32_t slot = p.slots[token];
    if (slot < 0) continue;  // padding or a token whose KV is not kept
    const int in_token = static_cast<int>(v % vectors_per_token);
    const int head = in_token / vectors_per_head;
    const int column = (in_token % vectors_per_head) * 8;
    const int64_t block = slot / p.block_tokens;
    const int row = slot % p.block_tokens;
    const int64_t source = token * p.row_stride + static_cast<int64_t>(head) * p.head_dim + column;
    // [blocks][num_kv_heads][block_tokens][head_dim]
    const int64_t dest =
        ((block * p.num_kv_heads + head) * p.block_tokens + row) * p.head_dim + column;
    *reinterpret_cast<uint4*>(p.key_pool + dest) = *reinterpret_cast<const uint4*>(p.keys + source);
    *reinterpret_cast<uint4*>(p.value_pool + dest) =
        *reinterpret_cast<const uint4*>(p.values + source);
  }
}

Status ValidateKvAppendParams(const KvAppendParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status AppendToPagedKv(const KvAppendParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidateKvAppendParams(params));
  if (params.tokens == 0 || params.num_kv_heads == 0) return Status::Ok();
  const int64_t vectors =
      static_cast<int64_t>(params.tokens) * params.num_kv_heads * (params.head_dim / 8);
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, kMaxBlocks);
  AppendToPagedKvKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  return LaunchStatus("AppendToPagedKvKernel");
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status ValidateKvAppendParams(const KvAppendParams& p) {
  const std::string op = "CUDA AppendToPagedKv: ";
  if (p.tokens < 0) return InvalidArgumentError(op + "tokens is " + std::to_string(p.tokens));
  if (p.num_kv_heads < 0) {
    return InvalidArgumentError(op + "num_kv_heads is " + std::to_string(p.num_kv_heads));
  }
  if (p.head_dim <= 0 || p.head_dim % 8 != 0) {
    return InvalidArgumentError(op + "head_dim is " + std::to_string(p.head_dim) +
                                "; it must be a positive multiple of 8 (16-byte rows)");
  }
  if (p.block_tokens <= 0) {
    return InvalidArgumentError(op + "block_tokens is " + std::to_string(p.block_tokens));
  }
  const int64_t heads_width = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  if (p.row_stride % 8 != 0 || p.row_stride < heads_width) {
    return InvalidArgumentError(op + "row_stride is " + std::to_string(p.row_stride) +
                                "; it must be a multiple of 8 and at least num_kv_heads * "
                                "head_dim = " +
                                std::to_string(heads_width));
  }
  if (p.tokens == 0 || p.num_kv_heads == 0) return Status::Ok();  // nothing is read or written
  if (p.keys == nullptr) return InvalidArgumentError(op + "keys is null");
  if (p.values == nullptr) return InvalidArgumentError(op + "values is null");
  if (p.slots == nullptr) return InvalidArgumentError(op + "slots is null");
  if (p.key_pool == nullptr) return InvalidArgumentError(op + "key_pool is null");
  if (p.value_pool == nullptr) return InvalidArgumentError(op + "value_pool is null");
  if (!Aligned16(p.keys)) return InvalidArgumentError(op + "keys is not 16-byte aligned");
  if (!Aligned16(p.values)) return InvalidArgumentError(op + "values is not 16-byte aligned");
  if (!Aligned16(p.key_pool)) return InvalidArgumentError(op + "key_pool is not 16-byte aligned");
  if (!Aligned16(p.value_pool)) {
    return InvalidArgumentError(op + "value_pool is not 16-byte aligned");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
