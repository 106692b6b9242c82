// Next-token selection on the GPU for a batch of logit rows: greedy, or temperature + top-k +
// top-p with one caller-supplied uniform draw per row. CPU twin: kernels/cpu/sampling.h
// (ArgMax / SampleTokenWithUniform): given the same logits and the same uniform, both pick the
// same token (up to fp32 rounding of probabilities right at a boundary).
//
// The uniform comes from the request's own std::mt19937_64 on the host (one draw per sampled
// token, none for greedy), so a request's tokens never depend on its batch and the CPU and CUDA
// engines draw the same random numbers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

// How one row is sampled (device array of these, one per row).
struct SamplingRow {
  float temperature = 0.f;     // 0 = greedy (argmax, lowest id on ties); else > 0
  int top_k = 0;               // 0 = off
  float top_p = 1.f;           // in (0, 1]; 1 = off
  double uniform = 0.0;        // in [0, 1): the row's draw, kernels/cpu DrawUniform's 53-bit value
                               // (double so that the CPU twin sees the very same number); unused
                               // when greedy
  int report_probability = 0;  // != 0: write the token's probability (SampleParams::probabilities)
};

// The row parameters are device data, so the launcher cannot check them; the engine validates
// requests. Outside the contract the kernel still writes a valid id: temperature <= 0 or NaN is
// greedy, top_k outside (0, vocab_size) and top_p >= 1 (or NaN) are off, the uniform is clamped
// to [0, 1], and a row without a finite logit (or with +inf) gets its argmax.
struct SampleParams {
  const float* logits = nullptr;  // [rows][vocab_size], f32
  int rows = 0;
  int vocab_size = 0;
  const SamplingRow* row_params = nullptr;  // [rows], device
  int32_t* tokens = nullptr;                // [rows], device: the chosen ids
  void* workspace = nullptr;  // SampleWorkspaceBytes(rows, vocab_size) bytes, 16-byte aligned:
                              // per row, f32 probabilities and int32 candidate ids (about
                              // 8 * vocab_size bytes); no contents carry over between calls
  size_t workspace_bytes = 0;
  // Optional, [rows], device: kernels/cpu TokenProbability of the chosen id (softmax of the row
  // at temperature 1) for rows with report_probability, -1 for the others. nullptr: not written.
  float* probabilities = nullptr;
};

size_t SampleWorkspaceBytes(int rows, int vocab_size);

// One thread block per row; no allocation, no synchronization (CUDA-graph capturable). rows == 0
// is a no-op. vocab_size up to 2^26.
Status SampleTokens(const SampleParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
