// Token embedding lookup on the GPU (embedding.cuh): gathers bf16 rows of the embedding table
// into the fp32 residual stream. A pure gather, so the only thing that matters is bandwidth:
// every thread moves one 16-byte piece of a table row (8 bf16) into 32 bytes of the output.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/launch_checks.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
// The grid is capped and the kernel strides over the rest, so that no shape can exceed the grid
// limit; 2^20 blocks of 256 threads is far more than enough to fill an H200.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// ---- kernel ----------------------------------------------------------------------------------

// The output is [tokens][hidden / 8] vectors of 8 elements, flattened; consecutive threads take
// consecutive vectors, so a warp reads 512 contiguous bytes of one table row.
__global__ void EmbeddingLookupKernel(EmbeddingParams p) {
  const int vectors_per_row = p.hidden / 8;
  const int64_t total = static_cast<int64_t>(p.tokens) * vectors_per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = v / vectors_per_row;
    const int column = static_cast<int>(v % vectors_per_row) * 8;
    const int32_t id = p.token_ids[token];
    float values[8];
    if (id >= 0 && id < p.vocab_size) {
      LoadBf16x8(p.table + static_cast<int64_t>(id) * p.hidden + column, values);
    } else {
      // The engine validates ids on the host; a bad one that slips through must be loud (NaN
      // logits) rather than a silent out-of-bounds read.
#pragma unroll
      for (int i = 0; i < 8; ++i) values[i] = __int_as_float(0x7fc00000);
    }
    float4* out = reinterpret_cast<float4*>(p.out + token * p.hidden + column);
    out[0] = make_float4(values[0], values[1], values[2], values[3]);
    out[1] = make_float4(values[4], values[5], values[6], values[7]);
  }
}

Status ValidateEmbeddingParams(const EmbeddingParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status EmbeddingLookup(const EmbeddingParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidateEmbeddingParams(params));
  if (params.tokens == 0) return Status::Ok();
  const int64_t vectors = static_cast<int64_t>(params.tokens) * (params.hidden / 8);
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, kMaxBlocks);
  EmbeddingLookupKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  return LaunchStatus("EmbeddingLookupKernel");
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status ValidateEmbeddingParams(const EmbeddingParams& p) {
  const std::string op = "CUDA EmbeddingLookup: ";
  if (p.tokens < 0) return InvalidArgumentError(op + "tokens is " + std::to_string(p.tokens));
  if (p.vocab_size <= 0) {
    return InvalidArgumentError(op + "vocab_size is " + std::to_string(p.vocab_size));
  }
  if (p.hidden <= 0 || p.hidden % 8 != 0) {
    return InvalidArgumentError(op + "hidden is " + std::to_string(p.hidden) +
                                "; it must be a positive multiple of 8 (16-byte rows)");
  }
  if (p.tokens == 0) return Status::Ok();  // nothing is read or written
  if (p.table == nullptr) return InvalidArgumentError(op + "table is null");
  if (p.token_ids == nullptr) return InvalidArgumentError(op + "token_ids is null");
  if (p.out == nullptr) return InvalidArgumentError(op + "out is null");
  if (!Aligned16(p.table)) return InvalidArgumentError(op + "table is not 16-byte aligned");
  if (!Aligned16(p.out)) return InvalidArgumentError(op + "out is not 16-byte aligned");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
