// The fidelity guard's query drift on the GPU (docs/fidelity.md): per request, a reference query
// per layer with RoPE taken out, and per step the mean over the query heads of the cosine of the
// current query (RoPE taken out) against it. CPU twin: QueryDriftGuard
// (inference_rank/attention/fidelity_guard.h), the same math in double. The two launchers are
// the guard's two halves over one pool of references and share the un-rotation, so they live in
// one pair. Both never synchronize and allocate nothing (CUDA-graph capturable).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct QueryDriftParams {
  // [rows][q_row_stride], bf16, after RoPE: the query heads first ([num_heads][head_dim]), as in
  // the model's fused q|k|v rows.
  const __nv_bfloat16* q = nullptr;
  int64_t q_row_stride = 0;  // >= num_heads * head_dim
  // [batch], device: the row of q holding entry b's query; null: row b.
  const int32_t* q_rows = nullptr;
  const int32_t* positions = nullptr;  // [batch], device: entry b's query position, >= 0
  // [batch], device: entry b's slot of the pool below; an entry whose slot is outside
  // [0, num_slots) (a caller bug) is skipped.
  const int32_t* slots = nullptr;
  int num_slots = 0;                // >= 1
  const float* inv_freq = nullptr;  // [head_dim / 2], f32: RoPE's (kernels/cpu/rope.h)
  // One layer's references, [num_slots][num_heads][head_dim] f32, RoPE taken out: written by
  // RememberQueries, read by AddQueryDrift.
  float* references = nullptr;
  // AddQueryDrift: [num_slots] f32, the per-request cosine sums over the layers.
  float* cosine_sums = nullptr;
  bool reset = false;  // AddQueryDrift: overwrite the sum (the first layer) instead of adding
  int batch = 0;       // >= 0; 0 is a no-op
  int num_heads = 0;   // in [1, 256]
  int head_dim = 0;    // even, in [2, 256]
};

// references[slot] = entry b's query with RoPE's rotation at positions[b] taken out: for
// i < half, x[i] c + x[i + half] s and x[i + half] c - x[i] s, c and s the precise sincosf of the
// fp32 angle float(position) * inv_freq[i] (the angle the forward rotated with). Other slots are
// left as they were. cosine_sums is not read.
Status RememberQueries(const QueryDriftParams& params, cudaStream_t stream);

// cosine_sums[slot] (reset: =, else +=) the mean over the query heads of cos(un-rotated q,
// references[slot]) (QueryDriftGuard::LayerCosine; a head with a zero vector counts 1). The
// reference must have been written (the slot's last slow step). Other slots are left as they
// were.
Status AddQueryDrift(const QueryDriftParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
