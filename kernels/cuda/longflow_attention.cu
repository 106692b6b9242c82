// LongFlow's fused attention and eviction choice (see longflow_attention.cuh). Two launches and
// the decode attention's merge:
//   1. the decode attention split kernel over the slot arrays (decode_attention_split.cuh
//      SlotsVariant): K and V tiles read once, S = Q K^T and P V on tensor cores, and from the
//      same tiles every slot's raw score (per query head) and ||v||_1 into the workspace; the
//      merge gives the output and each head's log-sum-exp;
//   2. ChooseKernel, one block per (KV head, sequence): alpha of each slot from its raw scores and
//      the heads' lse, the Eq. 6 score, and the next write slot by a block reduction.
// The exponentials are fp32 with the split kernel's tile-wise running maximum: one max per
// 64-key tile costs nothing there and no score can overflow, so the CPU twin's fallback pass has
// no GPU counterpart; used_max still reports the heads whose plain exponentials would have
// needed it (largest score past kLongFlowPlainExpLimit), as the twin does.
#include <cfloat>
#include <climits>
#include <cmath>
#include <string>

#include "kernels/cpu/longflow_attention.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/longflow_attention.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The workspace: the decode attention's, then raw scores [batch][num_heads][budget] (log2
// units), ||v||_1 [batch][num_kv_heads <= num_heads][budget] and lse [batch][num_heads].
struct Layout {
  size_t decode = 0, scores = 0, norms = 0, lse = 0, total = 0;
};

size_t AlignUp256(size_t bytes) { return (bytes + 255) / 256 * 256; }

Layout MakeLayout(int batch, int num_heads, int head_dim, int budget) {
  Layout layout;
  const size_t per_head = static_cast<size_t>(batch) * num_heads;
  layout.decode = 0;
  layout.scores =
      AlignUp256(DecodeAttentionWorkspaceBytes(batch, num_heads, head_dim, budget, false));
  layout.norms = AlignUp256(layout.scores + per_head * budget * sizeof(float));
  layout.lse = AlignUp256(layout.norms + per_head * budget * sizeof(float));
  layout.total = AlignUp256(layout.lse + per_head * sizeof(float));
  return layout;
}

struct Candidate {  // the least score past the sinks so far, ties to the lower slot
  float score;
  int slot;
};

__device__ Candidate Better(Candidate a, Candidate b) {
  return (b.score < a.score || (b.score == a.score && b.slot < a.slot)) ? b : a;
}

template <int kGroup>
__global__ void __launch_bounds__(kThreads)
    ChooseKernel(const LongFlowAttentionParams p, const float* scores, const float* norms,
                 const float* lse) {
  const int kv_head = blockIdx.x;
  const int b = blockIdx.y;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int array =
      p.arrays == nullptr ? b : min(max(p.arrays[b], 0), p.num_arrays - 1);  // its slot array
  const size_t first_slot = (static_cast<size_t>(b) * p.num_kv_heads + kv_head) * p.budget;
  const size_t first_head = static_cast<size_t>(b) * p.num_heads + kv_head * kGroup;
  const uint8_t* valid = p.valid + static_cast<size_t>(array) * p.budget;
  float lse2[kGroup];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) lse2[g] = lse[first_head + g] * kLog2e;  // -inf: no slot

  Candidate best{INFINITY, INT_MAX};
  int free_slot = INT_MAX;
  float largest = -INFINITY;  // the group's largest raw score (log2 units)
  for (int i = threadIdx.x; i < p.budget; i += kThreads) {
    float score = 0.f;
    if (valid[i]) {
      float alpha = 0.f;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const float s = scores[(first_head + g) * p.budget + i];
        largest = fmaxf(largest, s);
        if (lse2[g] != -INFINITY) alpha += exp2f(s - lse2[g]);
      }
      score = alpha / kGroup * norms[first_slot + i];
      if (i >= p.sink_slots) best = Better(best, Candidate{score, i});
    } else {
      free_slot = min(free_slot, i);
    }
    if (p.slot_scores != nullptr) p.slot_scores[first_slot + i] = score;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    best = Better(best, Candidate{__shfl_xor_sync(0xffffffffu, best.score, offset),
                                  __shfl_xor_sync(0xffffffffu, best.slot, offset)});
    free_slot = min(free_slot, __shfl_xor_sync(0xffffffffu, free_slot, offset));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  __shared__ Candidate warp_best[kWarps];
  __shared__ int warp_free[kWarps];
  __shared__ float warp_largest[kWarps];
  if (lane == 0) {
    warp_best[warp] = best;
    warp_free[warp] = free_slot;
    warp_largest[warp] = largest;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      best = Better(best, warp_best[w]);
      free_slot = min(free_slot, warp_free[w]);
      largest = fmaxf(largest, warp_largest[w]);
    }
    const size_t at = static_cast<size_t>(b) * p.num_kv_heads + kv_head;
    p.next_slot[static_cast<size_t>(array) * p.num_kv_heads + kv_head] =
        free_slot != INT_MAX   ? free_slot
        : best.slot != INT_MAX ? best.slot
                               : -1;
    if (p.used_max != nullptr) p.used_max[at] = largest * kLn2 > kLongFlowPlainExpLimit ? 1 : 0;
  }
}

}  // namespace

size_t LongFlowAttentionWorkspaceBytes(int batch, int num_heads, int head_dim, int budget) {
  if (batch < 1 || num_heads < 1 || head_dim < 1 || budget < 1) return 0;
  return MakeLayout(batch, num_heads, head_dim, budget).total;
}

Status LongFlowAttention(const LongFlowAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0) return Status::Ok();
  if (p.batch < 0 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0 || p.budget < 1 ||
      p.sink_slots < 0 || p.sink_slots > p.budget) {
    return InvalidArgumentError(
        "longflow attention: bad shape (batch " + std::to_string(p.batch) + ", heads " +
        std::to_string(p.num_heads) + "/" + std::to_string(p.num_kv_heads) + ", budget " +
        std::to_string(p.budget) + ", sinks " + std::to_string(p.sink_slots) + ")");
  }
  if (p.q == nullptr || p.keys == nullptr || p.values == nullptr || p.valid == nullptr ||
      p.out == nullptr || p.next_slot == nullptr || p.workspace == nullptr) {
    return InvalidArgumentError("longflow attention: a required pointer is null");
  }
  if (p.arrays != nullptr && p.num_arrays < 1) {
    return InvalidArgumentError("longflow attention: num_arrays must be >= 1 with arrays, got " +
                                std::to_string(p.num_arrays));
  }
  const size_t needed = LongFlowAttentionWorkspaceBytes(p.batch, p.num_heads, p.head_dim, p.budget);
  if (p.workspace_bytes < needed) {
    return InvalidArgumentError("longflow attention: workspace of " +
                                std::to_string(p.workspace_bytes) + " bytes, " +
                                std::to_string(needed) + " needed");
  }
  const Layout layout = MakeLayout(p.batch, p.num_heads, p.head_dim, p.budget);
  unsigned char* base = static_cast<unsigned char*>(p.workspace);
  float* scores = reinterpret_cast<float*>(base + layout.scores);
  float* norms = reinterpret_cast<float*>(base + layout.norms);
  float* lse = reinterpret_cast<float*>(base + layout.lse);

  DecodeAttentionParams d;
  d.q = p.q;
  d.q_row_stride = p.q_row_stride;
  d.slot_keys = p.keys;
  d.slot_values = p.values;
  d.slot_valid = p.valid;
  d.slot_budget = p.budget;
  d.slot_arrays = p.arrays;
  d.num_slot_arrays = p.num_arrays;
  d.slot_value_norms = norms;
  d.batch = p.batch;
  d.num_heads = p.num_heads;
  d.num_kv_heads = p.num_kv_heads;
  d.head_dim = p.head_dim;
  d.max_seq_len = p.budget;
  d.scale = p.scale;
  d.out = p.out;
  d.out_row_stride = p.out_row_stride;
  d.lse = lse;
  d.scores = scores;
  d.scores_stride = p.budget;
  d.workspace = base + layout.decode;
  d.workspace_bytes = layout.scores;
  const Status attention = DecodeAttention(d, stream);
  if (!attention.ok()) {
    return Status(attention.code(), "longflow attention: " + attention.message());
  }
  const int group = p.num_heads / p.num_kv_heads;
  RUBATO_DISPATCH_GQA_GROUP(group, kGroup, {
    ChooseKernel<kGroup>
        <<<dim3(p.num_kv_heads, p.batch), kThreads, 0, stream>>>(p, scores, norms, lse);
    return LaunchStatus("longflow choose kernel");
  });
}

}  // namespace rubato::cuda
