// SwiGLU on the GPU (swiglu.cuh): out = silu(gate) * up on the fused [tokens][gate | up] rows
// of the gate_up projection. Memory-bound: each thread reads 16 bytes of gate and 16 of up and
// writes 16 bytes of out.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/swiglu.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
// The grid is capped and the kernel strides over the rest (see embedding.cu).
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// ---- kernel ----------------------------------------------------------------------------------

// The output is [tokens][intermediate / 8] vectors, flattened; vector (t, c) reads gate at
// gate_up[t][8c..] and up at gate_up[t][intermediate + 8c..].
__global__ void SwiGluKernel(SwiGluParams p) {
  WaitForPriorGrids();
  const int vectors_per_row = p.intermediate / 8;
  const int64_t total = static_cast<int64_t>(p.tokens) * vectors_per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = v / vectors_per_row;
    const int column = static_cast<int>(v % vectors_per_row) * 8;
    const __nv_bfloat16* gate =
        p.gate_up + token * (2 * static_cast<int64_t>(p.intermediate)) + column;
    float g[8], u[8];
    LoadBf16x8(gate, g);
    LoadBf16x8(gate + p.intermediate, u);
    float out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      // torch's silu in fp32 with the precise expf (as the CPU twin): g / (1 + e^-g).
      out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    StoreBf16x8(p.out + token * p.intermediate + column, out);
  }
}

Status ValidateSwiGluParams(const SwiGluParams& p);

}  // namespace

// ---- launcher --------------------------------------------------------------------------------

Status SwiGlu(const SwiGluParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidateSwiGluParams(params));
  if (params.tokens == 0) return Status::Ok();
  const int64_t vectors = static_cast<int64_t>(params.tokens) * (params.intermediate / 8);
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, kMaxBlocks);
  LaunchPdl(SwiGluKernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, params);
  return LaunchStatus("SwiGluKernel");
}

// ---- validation ------------------------------------------------------------------------------

namespace {

Status ValidateSwiGluParams(const SwiGluParams& p) {
  const std::string op = "CUDA SwiGlu: ";
  if (p.tokens < 0) return InvalidArgumentError(op + "tokens is " + std::to_string(p.tokens));
  if (p.intermediate <= 0 || p.intermediate % 8 != 0) {
    return InvalidArgumentError(op + "intermediate is " + std::to_string(p.intermediate) +
                                "; it must be a positive multiple of 8 (16-byte rows)");
  }
  if (p.tokens == 0) return Status::Ok();  // nothing is read or written
  if (p.gate_up == nullptr) return InvalidArgumentError(op + "gate_up is null");
  if (p.out == nullptr) return InvalidArgumentError(op + "out is null");
  if (!Aligned16(p.gate_up)) return InvalidArgumentError(op + "gate_up is not 16-byte aligned");
  if (!Aligned16(p.out)) return InvalidArgumentError(op + "out is not 16-byte aligned");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
