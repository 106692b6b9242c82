// Logit adjustments on the GPU (logit_adjust.cuh): kernel, launcher, validation.
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/logit_adjust.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 128;

// Block r applies row r's deltas; the tokens of a row are distinct, so no two threads write one
// logit. __fadd_rn / __fsub_rn: the CPU twin's two roundings, never contracted.
__global__ void __launch_bounds__(kThreads) AdjustLogitsKernel(AdjustLogitsParams p) {
  const int row = static_cast<int>(blockIdx.x);
  const int begin = p.row_offsets[row];
  const int end = p.row_offsets[row + 1];
  float* logits = p.logits + static_cast<size_t>(row) * p.vocab_size;
  for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += kThreads) {
    const LogitDelta d = p.deltas[i];
    if (d.token < 0 || d.token >= p.vocab_size) continue;
    logits[d.token] = __fsub_rn(__fadd_rn(logits[d.token], d.bias), d.penalty);
  }
}

Status Validate(const AdjustLogitsParams& p) {
  const std::string op = "AdjustLogits: ";
  if (p.rows < 0) return InvalidArgumentError(op + "rows " + std::to_string(p.rows) + " < 0");
  if (p.rows == 0) return Status::Ok();
  if (p.vocab_size <= 0) {
    return InvalidArgumentError(op + "vocab_size " + std::to_string(p.vocab_size) + " must be > 0");
  }
  if (p.logits == nullptr) return InvalidArgumentError(op + "logits is null");
  if (p.row_offsets == nullptr) return InvalidArgumentError(op + "row_offsets is null");
  if (p.deltas == nullptr) return InvalidArgumentError(op + "deltas is null");
  return Status::Ok();
}

}  // namespace

Status AdjustLogits(const AdjustLogitsParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.rows == 0) return Status::Ok();
  AdjustLogitsKernel<<<params.rows, kThreads, 0, stream>>>(params);
  return LaunchStatus("adjust_logits");
}

}  // namespace rubato::cuda
