// SFI Selector on the GPU (SfiSelect): at a slow step, turns the dense attention's logits over
// the allowed key set J of each sequence of a batch into the K positions per KV head that fast
// steps attend (Eqs. 6–24 and our stage C "continuation"), ascending, on the device with no host
// round trip. CPU twin, whose documented choices are this op's contract too: sfi_selector.h
// (SelectSfi / ComputeSfiScores). In f32 with f64 sums: z_adj within rounding (~1e-5) of the
// f64 twin's, so a selection can differ from the CPU's only at near-ties.
// Narrative: docs/sfi.md "The GPU Selector".
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "inference_rank/policies/sfi/kernels/sfi_selector.h"

namespace rubato::cuda {

struct SfiSelectParams {
  // [batch][window][num_kv_heads * group][logits_stride], f32: element (b, w, q, p) is the logit
  // of query row w of query head q (q / group is its KV head) for KEY POSITION p. Sequence b's
  // allowed set is J = [j_begin[b], j_begin[b] + j_count[b]), so a row is read at positions
  // j_begin[b] .. j_begin[b] + j_count[b] - 1 and nowhere else. May contain -inf (a masked
  // position); every (row, query head) needs a finite logit on J (the CPU twin rejects a row of
  // -inf; here such a row contributes no probability). NaN counts as -inf and +inf as FLT_MAX.
  const float* logits = nullptr;
  int64_t logits_stride = 0;  // >= j_begin[b] + j_count[b] for every b (and >= max_j_count)
  // Multiplied into every logit before anything else: 1 for natural-log logits, ln 2 for the
  // log2-unit scores of rubato's dense decode kernel.
  float logit_scale = 1.f;
  const int32_t* j_begin = nullptr;  // [batch], device: first allowed position, >= 0
  const int32_t* j_count = nullptr;  // [batch], device: |J|, in [0, max_j_count]
  // [batch][num_kv_heads][norms_stride], f32: L2 norm of the cached key of KV head h at position
  // p (indexed by position like the logits). Read only when config.gamma > 0, may be null else.
  const float* key_norms = nullptr;
  int64_t norms_stride = 0;  // >= j_begin[b] + j_count[b] for every b when read
  int batch = 0;             // >= 0; 0 is a no-op
  int num_kv_heads = 0;      // H >= 1
  int group = 0;             // query heads per KV head >= 1
  int window = 0;            // W >= 1 query rows (1 in decode, 16 after prefill); W * group <= 1024
  int max_j_count = 0;       // host bound of j_count over the batch; fixes the grids and workspace
  SfiSelectorConfig config;  // validated like the CPU twin's, plus the f32 ranges below
  // [batch][num_kv_heads][config.budget]: the positions chosen for (b, h), ascending; entries
  // [selected_count[b][h], budget) are left as they were.
  int32_t* selected = nullptr;
  int32_t* selected_count = nullptr;  // [batch][num_kv_heads] = min(budget, j_count[b])
  // Optional: [batch][num_kv_heads][max_j_count], f32: the Eq. 23 score z_adj of position
  // j_begin[b] + i at index i < j_count[b] (what top-K ranks; the CPU twin's SfiScores::z_adj);
  // the rest of each row is left as it was.
  float* scores = nullptr;
  // Optional: [batch][num_kv_heads][max_j_count], f32: stage C's priority c_h of position
  // j_begin[b] + i at index i < j_count[b] (0 where no anchor reaches; the CPU twin's
  // SfiScores::continuation); the rest of each row is left as it was.
  float* continuation = nullptr;
  void* workspace = nullptr;  // SfiSelectWorkspaceBytes(...) bytes, device, 16-byte aligned
  size_t workspace_bytes = 0;
};

// Device scratch for these shapes: about 12 bytes per (sequence, KV head, position of
// max_j_count) (the evidence, the keys, stage C's priorities), 16 more when config.nms_window / 2
// exceeds 256 or config.continuation exceeds 32 (the wide-window maxima), plus per-chunk
// statistics that
// grow with window * group. The defaults cover window * group <= 128 and the default config;
// 0 when batch, num_kv_heads or max_j_count is <= 0 (then workspace may be null).
size_t SfiSelectWorkspaceBytes(int batch, int num_kv_heads, int max_j_count, int window = 16,
                               int group = 8, const SfiSelectorConfig& config = {});

// Runs the Selector for every (sequence, KV head) on `stream`; never synchronizes and allocates
// nothing (CUDA-graph capturable; the grids follow from the host bounds batch, num_kv_heads and
// max_j_count). InvalidArgument naming the field for bad shapes, null pointers, a short
// workspace or a bad config; besides ValidateSfiSelectorConfig the f32 pipeline needs
// alpha >= 1e-6, temperature in [1e-6, 1e6], epsilon in [1e-30, 1e6] and gamma, beta, p, eta,
// alpha_soft, alpha_cross <= 1e6 (bounds that keep every intermediate finite in f32), and
// num_kv_heads <= 64 (cross-head exclusivity keeps every head of a tile in shared memory).
//
// j_begin / j_count live on the device and cannot be checked here; outside the contract they are
// clamped (j_begin to >= 0, j_count to [0, max_j_count] and to what logits_stride, norms_stride
// and INT_MAX leave after j_begin), so the kernels never read outside the rows.
Status SfiSelect(const SfiSelectParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
