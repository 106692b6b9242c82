// SyncKV's selection evidence (group_max_probs.cuh): kernel, launcher, validation.
#include <cmath>
#include <string>

#include "inference_rank/policies/synckv/kernels/group_max_probs.cuh"
#include "kernels/cuda/cuda_status.h"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGroup = 32;

// A block-wide reduction of one float per thread (max or sum), the result in every thread.
template <bool kMax>
__device__ float BlockReduce(float value, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = kMax ? fmaxf(value, other) : value + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = kMax ? -INFINITY : 0.0f;
  for (int w = 0; w < kThreads / 32; ++w)
    value = kMax ? fmaxf(value, shared[w]) : value + shared[w];
  return value;
}

__device__ bool Contains(const int32_t* list, int count, int position) {
  int low = 0, high = count;
  while (low < high) {
    const int mid = (low + high) / 2;
    if (list[mid] < position) {
      low = mid + 1;
    } else {
      high = mid;
    }
  }
  return low < count && list[low] == position;
}

// One block per row: per head the max and the sum of exp2, then the pooled probabilities.
__global__ void GroupMaxProbsKernel(GroupMaxProbsParams p) {
  __shared__ float reduce[kThreads / 32];
  __shared__ float head_max[kMaxGroup];
  __shared__ float head_inverse[kMaxGroup];
  const int row = blockIdx.x;
  const int length = min(max(p.lengths[row], 0), p.max_length);
  const float* scores = p.scores + static_cast<int64_t>(row) * p.group * p.scores_stride;
  for (int g = 0; g < p.group; ++g) {
    const float* s = scores + g * p.scores_stride;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < length; i += kThreads) {
      if (isfinite(s[i])) m = fmaxf(m, s[i]);
    }
    m = BlockReduce<true>(m, reduce);
    float sum = 0.0f;
    if (m != -INFINITY) {
      for (int i = threadIdx.x; i < length; i += kThreads) {
        if (isfinite(s[i])) sum += exp2f(s[i] - m);
      }
    }
    sum = BlockReduce<false>(sum, reduce);
    if (threadIdx.x == 0) {
      head_max[g] = m;
      head_inverse[g] = m == -INFINITY ? 0.0f : 1.0f / sum;
    }
  }
  __syncthreads();
  int excluded_count = 0;
  const int32_t* excluded = nullptr;
  if (p.excluded != nullptr) {
    const int index = p.excluded_index != nullptr ? p.excluded_index[row] : row;
    excluded = p.excluded + static_cast<int64_t>(index) * p.excluded_row_stride;
    excluded_count = min(max(p.excluded_count[row], 0), p.excluded_capacity);
  }
  float* out = p.out + static_cast<int64_t>(row) * p.out_row_stride;
  for (int i = threadIdx.x; i < length; i += kThreads) {
    float best = 0.0f;
    for (int g = 0; g < p.group; ++g) {
      const float s = scores[g * p.scores_stride + i];
      if (head_max[g] != -INFINITY && isfinite(s)) {
        best = fmaxf(best, exp2f(s - head_max[g]) * head_inverse[g]);
      }
    }
    if (excluded_count > 0 && Contains(excluded, excluded_count, i)) best = -INFINITY;
    out[i] = best;
  }
}

Status Validate(const GroupMaxProbsParams& p) {
  const std::string op = "GroupMaxProbs: ";
  if (p.rows < 0) return InvalidArgumentError(op + "rows " + std::to_string(p.rows) + " < 0");
  if (p.rows == 0) return Status::Ok();
  if (p.group < 1 || p.group > kMaxGroup) {
    return InvalidArgumentError(op + "group " + std::to_string(p.group) + " outside [1, 32]");
  }
  if (p.max_length < 1 || p.scores_stride < p.max_length) {
    return InvalidArgumentError(op + "max_length " + std::to_string(p.max_length) +
                                " must lie in [1, scores_stride " +
                                std::to_string(p.scores_stride) + "]");
  }
  if (p.scores == nullptr || p.lengths == nullptr || p.out == nullptr) {
    return InvalidArgumentError(op + "scores, lengths and out are required");
  }
  if (p.out_row_stride < p.max_length) {
    return InvalidArgumentError(op + "out_row_stride " + std::to_string(p.out_row_stride) +
                                " < max_length " + std::to_string(p.max_length));
  }
  if (p.excluded != nullptr && (p.excluded_count == nullptr || p.excluded_capacity < 0 ||
                                p.excluded_row_stride < p.excluded_capacity)) {
    return InvalidArgumentError(op + "excluded needs excluded_count and excluded_row_stride >= " +
                                "excluded_capacity >= 0");
  }
  return Status::Ok();
}

}  // namespace

Status GroupMaxProbs(const GroupMaxProbsParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.rows == 0) return Status::Ok();
  GroupMaxProbsKernel<<<params.rows, kThreads, 0, stream>>>(params);
  return LaunchStatus("synckv_group_max_probs");
}

}  // namespace rubato::cuda
