// SmallRowsLinear (gemv.cuh). One warp per output feature: its lanes read the feature's weight
// row in 16-byte vectors, kUnroll loads in flight before any is used, multiply each by the same
// 8 elements of every x row (read through L1: all warps of a block share them), and reduce with
// xor shuffles. A block is 8 warps (8 features), so a 4096-feature layer is 512 blocks: enough
// warps on every SM to keep the copy bandwidth's worth of loads in flight.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemv.cuh"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/pdl.cuh"

namespace rubato::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kUnroll = 8;

__device__ __forceinline__ void Widen(const uint4& raw, float (&out)[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <int kRows>
__global__ void __launch_bounds__(kWarps * 32) GemvKernel(LinearArgs p) {
  WaitForPriorGrids();
  const int feature = blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (feature >= p.out_features) return;
  const int vectors = p.in_features / 8;
  const uint4* weight =
      reinterpret_cast<const uint4*>(p.weight + static_cast<int64_t>(feature) * p.in_features);
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
  for (int base = 0; base < vectors; base += 32 * kUnroll) {
    uint4 w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // the weights are read once: streamed past the caches
      const int v = base + 32 * u + lane;
      w[u] = v < vectors ? __ldcs(weight + v) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = base + 32 * u + lane;
      if (v >= vectors) break;
      float wf[8];
      Widen(w[u], wf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float xf[8];
        Widen(__ldg(reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(r) * p.in_features) +
                    v),
              xf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r] = fmaf(wf[i], xf[i], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
    }
  }
  if (lane != 0) return;
  const float bias = p.bias != nullptr ? __bfloat162float(p.bias[feature]) : 0.0f;
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.y);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    y[static_cast<int64_t>(r) * p.out_features + feature] = __float2bfloat16_rn(acc[r] + bias);
  }
}

}  // namespace

bool GemvApplies(const LinearArgs& args) {
  static const bool enabled = [] {
    const char* flag = std::getenv("RUBATO_GEMV");
    return flag == nullptr || std::string(flag) != "0";
  }();
  const double weight_bytes = 2.0 * args.in_features * static_cast<double>(args.out_features);
  return enabled && args.rows >= 1 && args.rows <= kGemvMaxRows && args.y_dtype == DType::kBF16 &&
         args.in_features % 8 == 0 && Aligned16(args.x) && Aligned16(args.weight) &&
         weight_bytes >= 8.0 * (1 << 20);
}

Status SmallRowsLinear(const LinearArgs& args, cudaStream_t stream) {
  if (!GemvApplies(args)) {
    return InvalidArgumentError("CUDA SmallRowsLinear: rows " + std::to_string(args.rows) +
                                ", in " + std::to_string(args.in_features) + ", out " +
                                std::to_string(args.out_features) +
                                " is not a shape it takes (GemvApplies)");
  }
  const dim3 grid(static_cast<unsigned>((args.out_features + kWarps - 1) / kWarps));
  const dim3 block(kWarps * 32);
  switch (args.rows) {
    case 1:
      LaunchPdl(GemvKernel<1>, grid, block, 0, stream, args);
      break;
    case 2:
      LaunchPdl(GemvKernel<2>, grid, block, 0, stream, args);
      break;
    case 3:
      LaunchPdl(GemvKernel<3>, grid, block, 0, stream, args);
      break;
    default:
      LaunchPdl(GemvKernel<4>, grid, block, 0, stream, args);
      break;
  }
  return LaunchStatus("GemvKernel");
}

}  // namespace rubato::cuda
