// Rotary position embedding on the GPU (rope.cuh): rotate_half pairs (i, i + head_dim / 2) of
// every q and k head, in place in the fused qkv projection.
//
// A thread owns 8 consecutive frequencies i..i+7 of one token: it computes their cos/sin once
// and applies them to kHeadsPerThread heads, loading the 16-byte vectors at i and at i + half
// of each. cos/sin are the precise sincosf of the fp32 angle float(position) * inv_freq[i]:
// positions reach 131072 and more, where __sinf / __cosf are off by far more than a bf16 ulp.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/rope.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
// Heads per thread: amortizes the 8 sincosf (a few dozen instructions each, more past |angle|
// ~1e5 where the slow argument reduction runs) over several heads, while a decode step with
// one token still spreads its ~40 heads over ~10 threads per frequency group.
constexpr int kHeadsPerThread = 4;

// ---- kernel ----------------------------------------------------------------------------------

// Per token, threads are numbered lane + kLanes * head_group (lane: which 8 frequencies;
// head_group: heads head_group, head_group + head_groups, ...), so adjacent threads touch
// adjacent 16-byte vectors of a head, then the next head.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) RopeKernel(RopeParams p, int head_groups) {
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kLanes = kHalf / 8;
  static_assert(kHalf % 8 == 0, "each half of a head must be whole 16-byte vectors");
  const int threads_per_token = kLanes * head_groups;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (thread >= static_cast<int64_t>(p.tokens) * threads_per_token) return;
  const int64_t token = thread / threads_per_token;
  const int in_token = static_cast<int>(thread % threads_per_token);
  const int lane = in_token % kLanes;
  const int head_group = in_token / kLanes;

  // As torch: the angle is one fp32 product (nothing to contract into an FMA), then cos/sin of
  // that fp32 value.
  const float position = static_cast<float>(p.positions[token]);
  float cos_angle[8], sin_angle[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float angle = position * p.inv_freq[8 * lane + i];
    sincosf(angle, &sin_angle[i], &cos_angle[i]);
  }

  __nv_bfloat16* row = p.x + token * p.row_stride + 8 * lane;
  for (int head = head_group; head < p.heads; head += head_groups) {
    __nv_bfloat16* first = row + static_cast<int64_t>(head) * kHeadDim;  // elements i..i+7
    __nv_bfloat16* second = first + kHalf;                               // i+half..i+half+7
    float x1[8], x2[8];
    LoadBf16x8(first, x1);
    LoadBf16x8(second, x2);
    float out1[8], out2[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out1[i] = x1[i] * cos_angle[i] - x2[i] * sin_angle[i];
      out2[i] = x2[i] * cos_angle[i] + x1[i] * sin_angle[i];
    }
    StoreBf16x8(first, out1);
    StoreBf16x8(second, out2);
  }
}

Status ValidateRopeParams(const RopeParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status ApplyRope(const RopeParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidateRopeParams(params));
  if (params.tokens == 0 || params.heads == 0) return Status::Ok();
  RUBATO_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, {
    const int head_groups = (params.heads + kHeadsPerThread - 1) / kHeadsPerThread;
    const int64_t threads = static_cast<int64_t>(params.tokens) * (kHeadDim / 16) * head_groups;
    const int64_t blocks = (threads + kThreads - 1) / kThreads;
    if (blocks > 0x7fffffff) {
      return InvalidArgumentError("CUDA ApplyRope: " + std::to_string(params.tokens) +
                                  " tokens x " + std::to_string(params.heads) +
                                  " heads is more than one launch can cover");
    }
    RopeKernel<kHeadDim>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params, head_groups);
    return LaunchStatus("RopeKernel");
  });
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status ValidateRopeParams(const RopeParams& p) {
  const std::string op = "CUDA ApplyRope: ";
  if (p.tokens < 0) return InvalidArgumentError(op + "tokens is " + std::to_string(p.tokens));
  if (p.heads < 0) return InvalidArgumentError(op + "heads is " + std::to_string(p.heads));
  if (p.head_dim <= 0 || p.head_dim % 2 != 0) {
    return InvalidArgumentError(op + "head_dim is " + std::to_string(p.head_dim) +
                                "; it must be positive and even");
  }
  // Unsupported even head_dim values are reported by the dispatch in the launcher.
  if (p.row_stride % 8 != 0 || p.row_stride < static_cast<int64_t>(p.heads) * p.head_dim) {
    return InvalidArgumentError(op + "row_stride is " + std::to_string(p.row_stride) +
                                "; it must be a multiple of 8 and at least heads * head_dim = " +
                                std::to_string(static_cast<int64_t>(p.heads) * p.head_dim));
  }
  if (p.tokens == 0 || p.heads == 0) return Status::Ok();  // nothing is read or written
  if (p.x == nullptr) return InvalidArgumentError(op + "x is null");
  if (p.positions == nullptr) return InvalidArgumentError(op + "positions is null");
  if (p.inv_freq == nullptr) return InvalidArgumentError(op + "inv_freq is null");
  if (!Aligned16(p.x)) return InvalidArgumentError(op + "x is not 16-byte aligned");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
