// The fidelity guard's query drift on the GPU (query_drift.cuh): one block per entry; the block
// builds the entry's cos/sin table once (precise sincosf of the fp32 angle, as the forward's RoPE
// does, so that the un-rotation undoes it exactly), then un-rotates its query heads. The cosine
// kernel reduces each head in one warp and sums the heads in a fixed order (deterministic).
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "inference_rank/policies/sfi/kernels/query_drift.cuh"
#include "kernels/cuda/cuda_status.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeads = 256;
constexpr int kMaxHalf = 128;  // head_dim <= 256

// ---- kernels ---------------------------------------------------------------------------------

// The entry's slot, or -1 when it is outside the pool (the entry is skipped).
__device__ int SlotOf(const QueryDriftParams& p, int entry) {
  const int slot = p.slots[entry];
  return slot >= 0 && slot < p.num_slots ? slot : -1;
}

// cos/sin of the angles at the entry's position into shared memory, then a barrier.
__device__ void AngleTable(const QueryDriftParams& p, int entry, float* cos_angle,
                           float* sin_angle) {
  const float position = static_cast<float>(p.positions[entry]);
  for (int i = threadIdx.x; i < p.head_dim / 2; i += blockDim.x) {
    sincosf(position * p.inv_freq[i], &sin_angle[i], &cos_angle[i]);  // one fp32 product
  }
  __syncthreads();
}

__device__ const __nv_bfloat16* QueryRow(const QueryDriftParams& p, int entry) {
  const int64_t row = p.q_rows != nullptr ? p.q_rows[entry] : entry;
  return p.q + row * p.q_row_stride;
}

// The pair (i, i + half) of one head with RoPE's rotation taken out (kernels/cpu/rope.h inverse).
__device__ float2 Unrotated(const __nv_bfloat16* head, int i, int half, float c, float s) {
  const float x1 = __bfloat162float(head[i]);
  const float x2 = __bfloat162float(head[i + half]);
  return make_float2(x1 * c + x2 * s, x2 * c - x1 * s);
}

__global__ void __launch_bounds__(kThreads) RememberQueriesKernel(QueryDriftParams p) {
  __shared__ float cos_angle[kMaxHalf], sin_angle[kMaxHalf];
  const int entry = blockIdx.x;
  const int slot = SlotOf(p, entry);
  if (slot < 0) return;  // the whole block: before any barrier
  AngleTable(p, entry, cos_angle, sin_angle);
  const int half = p.head_dim / 2;
  const __nv_bfloat16* q = QueryRow(p, entry);
  float* reference = p.references + static_cast<int64_t>(slot) * p.num_heads * p.head_dim;
  for (int at = threadIdx.x; at < p.num_heads * half; at += blockDim.x) {
    const int head = at / half, i = at % half;
    const int64_t first = static_cast<int64_t>(head) * p.head_dim;
    const float2 x = Unrotated(q + first, i, half, cos_angle[i], sin_angle[i]);
    reference[first + i] = x.x;
    reference[first + i + half] = x.y;
  }
}

__global__ void __launch_bounds__(kThreads) AddQueryDriftKernel(QueryDriftParams p) {
  __shared__ float cos_angle[kMaxHalf], sin_angle[kMaxHalf];
  __shared__ float head_cosine[kMaxHeads];
  const int entry = blockIdx.x;
  const int slot = SlotOf(p, entry);
  if (slot < 0) return;
  AngleTable(p, entry, cos_angle, sin_angle);
  const int half = p.head_dim / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const __nv_bfloat16* q = QueryRow(p, entry);
  const float* reference = p.references + static_cast<int64_t>(slot) * p.num_heads * p.head_dim;
  for (int head = warp; head < p.num_heads; head += kWarps) {
    const int64_t first = static_cast<int64_t>(head) * p.head_dim;
    float dot = 0.f, aa = 0.f, bb = 0.f;
    for (int i = lane; i < half; i += 32) {
      const float2 x = Unrotated(q + first, i, half, cos_angle[i], sin_angle[i]);
      const float r1 = reference[first + i], r2 = reference[first + i + half];
      dot += x.x * r1 + x.y * r2;
      aa += x.x * x.x + x.y * x.y;
      bb += r1 * r1 + r2 * r2;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      aa += __shfl_xor_sync(0xffffffffu, aa, offset);
      bb += __shfl_xor_sync(0xffffffffu, bb, offset);
    }
    // A zero query has no direction: it asks for nothing the reference did not (the twin's 1).
    if (lane == 0) head_cosine[head] = aa > 0.f && bb > 0.f ? dot / (sqrtf(aa) * sqrtf(bb)) : 1.f;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  float sum = 0.f;
  for (int head = 0; head < p.num_heads; ++head) sum += head_cosine[head];
  const float mean = sum / static_cast<float>(p.num_heads);
  p.cosine_sums[slot] = p.reset ? mean : p.cosine_sums[slot] + mean;
}

// ---- validation --------------------------------------------------------------------------------

Status Validate(const QueryDriftParams& p, const std::string& op, bool sums) {
  auto error = [&op](const std::string& what) { return InvalidArgumentError(op + what); };
  if (p.batch < 0) return error("batch is " + std::to_string(p.batch));
  if (p.num_heads < 1 || p.num_heads > kMaxHeads) {
    return error("num_heads is " + std::to_string(p.num_heads) + "; it must be in [1, " +
                 std::to_string(kMaxHeads) + "]");
  }
  if (p.head_dim < 2 || p.head_dim % 2 != 0 || p.head_dim > 2 * kMaxHalf) {
    return error("head_dim is " + std::to_string(p.head_dim) + "; it must be even, in [2, " +
                 std::to_string(2 * kMaxHalf) + "]");
  }
  if (p.q_row_stride < static_cast<int64_t>(p.num_heads) * p.head_dim) {
    return error(
        "q_row_stride is " + std::to_string(p.q_row_stride) +
        "; it must be at least num_heads * head_dim = " + std::to_string(p.num_heads * p.head_dim));
  }
  if (p.num_slots < 1) return error("num_slots is " + std::to_string(p.num_slots));
  if (p.batch == 0) return Status::Ok();  // nothing is read or written
  if (p.q == nullptr) return error("q is null");
  if (p.positions == nullptr) return error("positions is null");
  if (p.slots == nullptr) return error("slots is null");
  if (p.inv_freq == nullptr) return error("inv_freq is null");
  if (p.references == nullptr) return error("references is null");
  if (sums && p.cosine_sums == nullptr) return error("cosine_sums is null");
  return Status::Ok();
}

}  // namespace

// ---- launchers ---------------------------------------------------------------------------------

Status RememberQueries(const QueryDriftParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params, "CUDA RememberQueries: ", /*sums=*/false));
  if (params.batch == 0) return Status::Ok();
  RememberQueriesKernel<<<params.batch, kThreads, 0, stream>>>(params);
  return LaunchStatus("RememberQueries");
}

Status AddQueryDrift(const QueryDriftParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params, "CUDA AddQueryDrift: ", /*sums=*/true));
  if (params.batch == 0) return Status::Ok();
  AddQueryDriftKernel<<<params.batch, kThreads, 0, stream>>>(params);
  return LaunchStatus("AddQueryDrift");
}

}  // namespace rubato::cuda
