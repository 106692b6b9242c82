// SnapKV-style prompt scoring (snapkv_scores.cuh): kernels, launcher, validation. Scores are
// small work next to the prefill itself (window x length dot products per query head), so the
// kernels favour plainness: a warp per key for the logits, exact expf, and the CPU twin's order
// of summation (window outer, group inner).
#include <cfloat>
#include <cmath>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/snapkv_scores.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

size_t AlignUp256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The weights: [num_heads][window][length] f32; then the sums: [num_kv_heads][prefix] f32.
size_t WeightsBytes(int num_heads, int window, int length) {
  return AlignUp256(sizeof(float) * static_cast<size_t>(num_heads) * window * length);
}

__device__ float BlockReduce(float value, bool take_max, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = take_max ? fmaxf(value, other) : value + other;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // `shared` may still be read from a previous reduction
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = shared[0];
  for (int w = 1; w < kWarps; ++w) value = take_max ? fmaxf(value, shared[w]) : value + shared[w];
  return value;
}

// One block per (query head, window query): logits over keys [0, prefix + w], then the softmax
// in place (max subtracted, as the twin's SoftmaxInPlace). Only the prefix weights are kept.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    WindowSoftmaxKernel(const SnapKvScoresParams p, float* weights) {
  constexpr int kPerLane = (kHeadDim + 31) / 32;
  const int head = blockIdx.x;
  const int w = blockIdx.y;
  const int group = p.num_heads / p.num_kv_heads;
  const int kv_head = head / group;
  const int prefix = p.length - p.window;
  const int keys = prefix + w + 1;
  const float scale = rsqrtf(static_cast<float>(kHeadDim));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* row = weights + (static_cast<size_t>(head) * p.window + w) * p.length;
  const __nv_bfloat16* q = p.window_queries + w * p.q_row_stride + head * kHeadDim;
  float q_lane[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    q_lane[i] = d < kHeadDim ? __bfloat162float(q[d]) : 0.f;
  }
  float local_max = -INFINITY;
  for (int key = warp; key < keys; key += kWarps) {
    const int64_t block = p.block_table[key / p.block_tokens];
    const __nv_bfloat16* k =
        p.key_pool +
        ((block * p.num_kv_heads + kv_head) * p.block_tokens + key % p.block_tokens) * kHeadDim;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < kHeadDim) dot += q_lane[i] * __bfloat162float(k[d]);
    }
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) row[key] = dot * scale;
    local_max = fmaxf(local_max, dot * scale);
  }
  __shared__ float shared[kWarps];
  __syncthreads();  // the logits written by lane 0 of each warp
  const float max_value = BlockReduce(local_max, true, shared);
  float local_sum = 0.f;
  for (int key = threadIdx.x; key < keys; key += kThreads) {
    const float e = expf(row[key] - max_value);
    row[key] = e;
    local_sum += e;
  }
  const float inv_sum = 1.f / BlockReduce(local_sum, false, shared);
  for (int key = threadIdx.x; key < prefix; key += kThreads) row[key] *= inv_sum;
}

// One thread per (KV head, prefix position): the sum over the window and the group.
__global__ void __launch_bounds__(kThreads)
    SumKernel(const SnapKvScoresParams p, const float* weights, float* summed) {
  const int prefix = p.length - p.window;
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= static_cast<int64_t>(p.num_kv_heads) * prefix) return;
  const int kv_head = static_cast<int>(index / prefix);
  const int position = static_cast<int>(index % prefix);
  float sum = 0.f;
  for (int w = 0; w < p.window; ++w) {
    for (int g = 0; g < group; ++g) {
      const int head = kv_head * group + g;
      sum += weights[(static_cast<size_t>(head) * p.window + w) * p.length + position];
    }
  }
  summed[index] = sum;
}

// One thread per (KV head, prefix position): the max over the pooling window.
__global__ void __launch_bounds__(kThreads)
    PoolKernel(const SnapKvScoresParams p, const float* summed) {
  const int prefix = p.length - p.window;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= static_cast<int64_t>(p.num_kv_heads) * prefix) return;
  const int kv_head = static_cast<int>(index / prefix);
  const int position = static_cast<int>(index % prefix);
  const int half = p.pool_kernel / 2;
  const float* row = summed + static_cast<int64_t>(kv_head) * prefix;
  float best = -FLT_MAX;
  for (int i = max(0, position - half); i < min(prefix, position + half + 1); ++i) {
    best = fmaxf(best, row[i]);
  }
  p.scores[kv_head * p.scores_stride + position] = best;
}

Status Validate(const SnapKvScoresParams& p) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("snapkv scores (CUDA): " + what);
  };
  if (p.num_kv_heads < 1 || p.num_heads < 1 || p.num_heads % p.num_kv_heads != 0) {
    return invalid("num_heads " + std::to_string(p.num_heads) +
                   " is not a positive multiple of num_kv_heads " + std::to_string(p.num_kv_heads));
  }
  if (p.window < 1 || p.window >= p.length || p.window > 65535) {
    return invalid("window " + std::to_string(p.window) + " outside [1, min(length " +
                   std::to_string(p.length) + ", 65536))");
  }
  if (p.pool_kernel < 1 || p.pool_kernel % 2 == 0) {
    return invalid("pool_kernel " + std::to_string(p.pool_kernel) + " is not odd and positive");
  }
  if (p.block_tokens < 1 || p.num_pool_blocks < 1) {
    return invalid("block_tokens and num_pool_blocks must be >= 1");
  }
  if (p.scores_stride < p.length - p.window) {
    return invalid("scores_stride " + std::to_string(p.scores_stride) + " < length - window " +
                   std::to_string(p.length - p.window));
  }
  if (p.q_row_stride < static_cast<int64_t>(p.num_heads) * p.head_dim) {
    return invalid("q_row_stride " + std::to_string(p.q_row_stride) + " does not hold every head");
  }
  if (p.window_queries == nullptr || p.key_pool == nullptr || p.block_table == nullptr ||
      p.scores == nullptr || p.workspace == nullptr) {
    return invalid("a required pointer is null");
  }
  const size_t needed = SnapKvScoresWorkspaceBytes(p.num_heads, p.num_kv_heads, p.window, p.length);
  if (p.workspace_bytes < needed) {
    return invalid("workspace of " + std::to_string(p.workspace_bytes) + " bytes, " +
                   std::to_string(needed) + " needed (SnapKvScoresWorkspaceBytes)");
  }
  return Status::Ok();
}

}  // namespace

size_t SnapKvScoresWorkspaceBytes(int num_heads, int num_kv_heads, int window, int length) {
  if (num_heads < 1 || num_kv_heads < 1 || window < 1 || length <= window) return 0;
  return WeightsBytes(num_heads, window, length) +
         AlignUp256(sizeof(float) * static_cast<size_t>(num_kv_heads) * (length - window));
}

Status SnapKvScores(const SnapKvScoresParams& p, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(p));
  auto* base = static_cast<unsigned char*>(p.workspace);
  float* weights = reinterpret_cast<float*>(base);
  float* summed = reinterpret_cast<float*>(base + WeightsBytes(p.num_heads, p.window, p.length));
  RUBATO_DISPATCH_HEAD_DIM(p.head_dim, kHeadDim, {
    WindowSoftmaxKernel<kHeadDim><<<dim3(p.num_heads, p.window), kThreads, 0, stream>>>(p, weights);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("snapkv window softmax"));
    const int64_t cells = static_cast<int64_t>(p.num_kv_heads) * (p.length - p.window);
    const unsigned blocks = static_cast<unsigned>((cells + kThreads - 1) / kThreads);
    SumKernel<<<blocks, kThreads, 0, stream>>>(p, weights, summed);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("snapkv sum"));
    PoolKernel<<<blocks, kThreads, 0, stream>>>(p, summed);
    return LaunchStatus("snapkv pool");
  });
}

}  // namespace rubato::cuda
