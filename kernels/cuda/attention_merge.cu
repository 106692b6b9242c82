// The split-K merge of two partial attention results (attention_merge.cuh): kernel, launcher,
// validation. A pure streaming op: each thread merges one 16-byte vector (8 dims) of one head.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/attention_merge.cuh"
#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_checks.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // the kernel strides over the rest

// ---- kernel ----------------------------------------------------------------------------------

// Work item v: row r, head h, vector c of [rows][num_heads][head_dim / 8], flattened.
__global__ void AttentionMergeKernel(const AttentionMergeParams p) {
  const int vectors_per_head = p.head_dim / 8;
  const int64_t vectors_per_row = static_cast<int64_t>(p.num_heads) * vectors_per_head;
  const int64_t total = vectors_per_row * p.rows;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = v / vectors_per_row;
    const int64_t in_row = v % vectors_per_row;
    const int64_t stat = row * p.num_heads + in_row / vectors_per_head;
    const int64_t column = in_row * 8;  // head * head_dim + 8 * vector
    const float lse_a = p.lse_a[stat];
    const float lse_b = p.lse_b[stat];
    const float max_lse = fmaxf(lse_a, lse_b);
    float merged[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float merged_lse = -INFINITY;  // both sides empty: o 0, lse -inf
    if (max_lse != -INFINITY) {
      // An empty side weighs exactly 0 and its o is never multiplied (0 x NaN is NaN).
      const float weight_a = lse_a == -INFINITY ? 0.f : expf(lse_a - max_lse);
      const float weight_b = lse_b == -INFINITY ? 0.f : expf(lse_b - max_lse);
      const float total_weight = weight_a + weight_b;  // in [1, 2]
      const float scale_a = weight_a / total_weight;
      const float scale_b = weight_b / total_weight;
      float a[8], b[8];
      LoadBf16x8(p.o_a + row * p.o_a_row_stride + column, a);
      LoadBf16x8(p.o_b + row * p.o_b_row_stride + column, b);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (weight_a != 0.f) merged[i] += scale_a * a[i];
        if (weight_b != 0.f) merged[i] += scale_b * b[i];
      }
      merged_lse = max_lse + logf(total_weight);
    }
    // The head's first vector writes its lse (which is why lse_out may not alias lse_a / lse_b:
    // the head's other vectors read them, possibly later).
    if (p.lse_out != nullptr && column % p.head_dim == 0) p.lse_out[stat] = merged_lse;
    StoreBf16x8(p.out + row * p.out_row_stride + column, merged);
  }
}

Status Validate(const AttentionMergeParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status MergeAttention(const AttentionMergeParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.rows == 0) return Status::Ok();
  const int64_t vectors =
      static_cast<int64_t>(params.rows) * params.num_heads * (params.head_dim / 8);
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, kMaxBlocks);
  AttentionMergeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params);
  return LaunchStatus("attention_merge");
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status Validate(const AttentionMergeParams& p) {
  const std::string op = "CUDA MergeAttention: ";
  if (p.rows < 0) return InvalidArgumentError(op + "rows " + std::to_string(p.rows) + " < 0");
  if (p.rows == 0) return Status::Ok();
  if (p.num_heads < 1) {
    return InvalidArgumentError(op + "num_heads " + std::to_string(p.num_heads) + " < 1");
  }
  if (p.head_dim < 8 || p.head_dim % 8 != 0) {
    return InvalidArgumentError(op + "head_dim " + std::to_string(p.head_dim) +
                                " must be a positive multiple of 8");
  }
  if (p.o_a == nullptr) return InvalidArgumentError(op + "o_a is null");
  if (p.lse_a == nullptr) return InvalidArgumentError(op + "lse_a is null");
  if (p.o_b == nullptr) return InvalidArgumentError(op + "o_b is null");
  if (p.lse_b == nullptr) return InvalidArgumentError(op + "lse_b is null");
  if (p.out == nullptr) return InvalidArgumentError(op + "out is null");
  const int64_t row = static_cast<int64_t>(p.num_heads) * p.head_dim;
  const auto check_stride = [&](const char* field, int64_t stride) {
    if (stride >= row && stride % 8 == 0) return Status::Ok();
    return InvalidArgumentError(op + field + " " + std::to_string(stride) +
                                " must be a multiple of 8 and >= num_heads * head_dim " +
                                std::to_string(row));
  };
  RUBATO_RETURN_IF_ERROR(check_stride("o_a_row_stride", p.o_a_row_stride));
  RUBATO_RETURN_IF_ERROR(check_stride("o_b_row_stride", p.o_b_row_stride));
  RUBATO_RETURN_IF_ERROR(check_stride("out_row_stride", p.out_row_stride));
  if (p.lse_out != nullptr && (p.lse_out == p.lse_a || p.lse_out == p.lse_b)) {
    return InvalidArgumentError(op + "lse_out must not be lse_a or lse_b (a separate buffer)");
  }
  if (!Aligned16(p.o_a) || !Aligned16(p.o_b) || !Aligned16(p.out)) {
    return InvalidArgumentError(op + "o_a, o_b and out must be 16-byte aligned");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
