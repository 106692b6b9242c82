// OpenAI's logit processors (presence / frequency penalties, logit_bias) on the GPU, applied to
// a batch of f32 logit rows in place before the sampler reads them. The host turns each row's
// adjustments into sparse deltas (kernels/cpu/sampling.h BuildLogitDeltas, a few per generated
// token); this op applies them. CPU twin: ApplyLogitDeltas, with the same two roundings per logit,
// so both backends sample from bitwise-equal logits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"
#include "kernels/cpu/sampling.h"

namespace rubato::cuda {

struct AdjustLogitsParams {
  float* logits = nullptr;  // [rows][vocab_size], f32, adjusted in place
  int rows = 0;
  int vocab_size = 0;
  // CSR over the rows, device: row r's deltas are deltas[row_offsets[r], row_offsets[r + 1]),
  // distinct tokens within a row. [rows + 1] int32, non-decreasing, row_offsets[0] = 0.
  const int32_t* row_offsets = nullptr;
  const LogitDelta* deltas = nullptr;  // [row_offsets[rows]], device
};

// One block per row; no allocation, no synchronization (CUDA-graph capturable). rows == 0 is a
// no-op. Offsets and tokens live on the device, so the launcher cannot check them: a delta whose
// token is outside [0, vocab_size) is skipped, and a row whose offsets decrease applies nothing.
Status AdjustLogits(const AdjustLogitsParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
