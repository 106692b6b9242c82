// Index-gather sparse decode attention (see index_gather_attention.cuh). Split kernel: one block
// of 4 warps per (split, KV head, sequence); each warp takes kUnroll positions of the split's
// range at a time (their key and value rows loaded before any is used, so that 2 kUnroll row
// loads are in flight), a lane holds head_dim / 32 dimensions of the group's queries and of each
// row (one vector load), scores are reduced across the warp and folded into an online softmax
// in log2 units; the warps merge in shared memory and write one partial (output, max, sum) per
// (split, query head). The merge kernel combines the splits.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/bf16_vec.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/index_gather_attention.cuh"

namespace rubato::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSplits = 64;
constexpr int kUnroll = 4;
constexpr float kLog2e = 1.4426950408889634f;

struct Partials {  // views of the workspace
  float* out;      // [batch][num_heads][splits][head_dim]
  float* max;      // [batch][num_heads][splits], log2 units
  float* sum;      // [batch][num_heads][splits]
};

Partials PartialsOf(void* workspace, int batch, int num_heads, int head_dim, int splits) {
  float* base = static_cast<float*>(workspace);
  const size_t rows = static_cast<size_t>(batch) * num_heads * splits;
  return Partials{base, base + rows * head_dim, base + rows * head_dim + rows};
}

template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kThreads)
    IndexGatherSplitKernel(IndexGatherAttentionParams p, Partials partials, int splits, int chunk) {
  constexpr int kPerLane = kHeadDim / 32;
  const int split = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int list_head = p.head_map != nullptr ? p.head_map[kv_head] : kv_head;
  const size_t list_row = static_cast<size_t>(b) * p.list_heads + list_head;
  const int count = min(max(p.counts[list_row], 0), p.capacity);
  const int32_t* list = p.lists + list_row * p.capacity;
  const int begin = split * chunk;
  const int end = min(begin + chunk, count);

  float q[kGroup][kPerLane];
  const float q_scale = p.scale * kLog2e;
  for (int g = 0; g < kGroup; ++g) {
    const __nv_bfloat16* row =
        p.q + b * p.q_row_stride + static_cast<int64_t>(kv_head * kGroup + g) * kHeadDim;
    for (int e = 0; e < kPerLane; ++e)
      q[g][e] = __bfloat162float(row[lane * kPerLane + e]) * q_scale;
  }
  float m[kGroup], l[kGroup], acc[kGroup][kPerLane];
  for (int g = 0; g < kGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    for (int e = 0; e < kPerLane; ++e) acc[g][e] = 0.f;
  }
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.block_table_stride;
  for (int i0 = begin + warp * kUnroll; i0 < end; i0 += kWarps * kUnroll) {
    float k[kUnroll][kPerLane], v[kUnroll][kPerLane];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      valid[u] = i0 + u < end;
      const int position = valid[u] ? list[i0 + u] : list[begin];
      const int64_t block = table[position / p.block_tokens];
      const int64_t offset =
          ((block * p.num_kv_heads + kv_head) * p.block_tokens + position % p.block_tokens) *
              kHeadDim +
          lane * kPerLane;
      LoadBf16xN<kPerLane>(p.key_pool + offset, k[u]);
      LoadBf16xN<kPerLane>(p.value_pool + offset, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!valid[u]) continue;  // warp-uniform
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) s += q[g][e] * k[u][e];
#pragma unroll
        for (int step = 16; step > 0; step >>= 1) s += __shfl_xor_sync(0xffffffffu, s, step);
        const float m_new = fmaxf(m[g], s);
        const float correction = exp2f(m[g] - m_new);
        const float weight = exp2f(s - m_new);
        l[g] = l[g] * correction + weight;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          acc[g][e] = acc[g][e] * correction + weight * v[u][e];
        }
        m[g] = m_new;
      }
    }
  }

  // Merge the warps: warp w's (m, l, acc) into shared memory, then thread t of the block
  // combines dimension t % head_dim of the group's heads.
  __shared__ float shared_m[kWarps][kGroup];
  __shared__ float shared_l[kWarps][kGroup];
  __shared__ float shared_acc[kWarps][kGroup][kHeadDim];
  for (int g = 0; g < kGroup; ++g) {
    if (lane == 0) {
      shared_m[warp][g] = m[g];
      shared_l[warp][g] = l[g];
    }
    for (int e = 0; e < kPerLane; ++e) shared_acc[warp][g][lane * kPerLane + e] = acc[g][e];
  }
  __syncthreads();
  for (int item = threadIdx.x; item < kGroup * kHeadDim; item += kThreads) {
    const int g = item / kHeadDim;
    const int d = item % kHeadDim;
    float total_m = -INFINITY;
    for (int w = 0; w < kWarps; ++w) total_m = fmaxf(total_m, shared_m[w][g]);
    float total_l = 0.f, total_acc = 0.f;
    if (total_m != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float factor = exp2f(shared_m[w][g] - total_m);  // 0 for an empty warp
        total_l += shared_l[w][g] * factor;
        total_acc += shared_acc[w][g][d] * factor;
      }
    }
    const size_t row =
        (static_cast<size_t>(b) * p.num_heads + kv_head * kGroup + g) * splits + split;
    partials.out[row * kHeadDim + d] = total_acc;
    if (d == 0) {
      partials.max[row] = total_m;
      partials.sum[row] = total_l;
    }
  }
}

template <int kHeadDim>
__global__ void IndexGatherMergeKernel(IndexGatherAttentionParams p, Partials partials,
                                       int splits) {
  const int b = blockIdx.x / p.num_heads;
  const int head = blockIdx.x % p.num_heads;
  const size_t first = (static_cast<size_t>(b) * p.num_heads + head) * splits;
  float total_m = -INFINITY;
  for (int s = 0; s < splits; ++s) total_m = fmaxf(total_m, partials.max[first + s]);
  __nv_bfloat16* out = p.out + b * p.out_row_stride + static_cast<int64_t>(head) * kHeadDim;
  float total_l = 0.f;
  if (total_m != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      total_l += partials.sum[first + s] * exp2f(partials.max[first + s] - total_m);
    }
  }
  for (int d = threadIdx.x; d < kHeadDim; d += blockDim.x) {
    float value = 0.f;
    if (total_l > 0.f) {
      for (int s = 0; s < splits; ++s) {
        value +=
            partials.out[(first + s) * kHeadDim + d] * exp2f(partials.max[first + s] - total_m);
      }
      value /= total_l;
    }
    out[d] = __float2bfloat16(value);
  }
  if (p.lse != nullptr && threadIdx.x == 0) {
    p.lse[static_cast<size_t>(b) * p.num_heads + head] =
        total_l > 0.f ? (total_m + log2f(total_l)) / kLog2e : -INFINITY;
  }
}

template <int kHeadDim, int kGroup>
Status Launch(const IndexGatherAttentionParams& p, cudaStream_t stream) {
  if constexpr (kHeadDim < 32) {
    return UnsupportedError("index-gather attention: head_dim " + std::to_string(kHeadDim) +
                            " (supported: 32, 64, 128)");
  } else {
    const int splits =
        IndexGatherAttentionSplits(p.batch, p.num_kv_heads, p.capacity, p.num_splits);
    const int chunk = (p.capacity + splits - 1) / splits;
    const Partials partials = PartialsOf(p.workspace, p.batch, p.num_heads, kHeadDim, splits);
    IndexGatherSplitKernel<kHeadDim, kGroup>
        <<<dim3(splits, p.num_kv_heads, p.batch), kThreads, 0, stream>>>(p, partials, splits,
                                                                         chunk);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("index-gather attention split kernel"));
    IndexGatherMergeKernel<kHeadDim>
        <<<p.batch * p.num_heads, kHeadDim, 0, stream>>>(p, partials, splits);
    return LaunchStatus("index-gather attention merge kernel");
  }
}

}  // namespace

namespace {
int MostSplits(int capacity) { return std::max(1, std::min(kMaxSplits, (capacity + 63) / 64)); }
}  // namespace

int IndexGatherAttentionSplits(int batch, int num_kv_heads, int capacity, int num_splits) {
  const int most = MostSplits(capacity);
  if (num_splits > 0) return std::min(num_splits, most);
  // About eight blocks (32 warps) per multiprocessor of an H100 (132): a warp waits on its row
  // loads, so many must be resident; at least 64 positions per split.
  const int blocks = std::max(1, batch * num_kv_heads);
  return std::max(1, std::min(most, (8 * 132 + blocks - 1) / blocks));
}

size_t IndexGatherAttentionWorkspaceBytes(int batch, int num_heads, int head_dim, int capacity,
                                          int num_splits) {
  // Sized for the most splits the capacity allows, whatever the launch chooses: a workspace made
  // for a batch serves every smaller one.
  const int splits =
      num_splits > 0 ? std::min(num_splits, MostSplits(capacity)) : MostSplits(capacity);
  const size_t rows = static_cast<size_t>(batch) * num_heads * splits;
  return rows * (static_cast<size_t>(head_dim) + 2) * sizeof(float);
}

Status IndexGatherAttention(const IndexGatherAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0) return Status::Ok();
  if (p.batch < 0 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0 || p.capacity < 1 ||
      p.list_heads < 1 || p.block_tokens < 1) {
    return InvalidArgumentError(
        "index-gather attention: bad shape (batch " + std::to_string(p.batch) + ", heads " +
        std::to_string(p.num_heads) + "/" + std::to_string(p.num_kv_heads) + ", capacity " +
        std::to_string(p.capacity) + ", list heads " + std::to_string(p.list_heads) + ")");
  }
  if (p.q == nullptr || p.key_pool == nullptr || p.value_pool == nullptr ||
      p.block_tables == nullptr || p.lists == nullptr || p.counts == nullptr || p.out == nullptr ||
      p.workspace == nullptr) {
    return InvalidArgumentError("index-gather attention: a required pointer is null");
  }
  const size_t needed = IndexGatherAttentionWorkspaceBytes(p.batch, p.num_heads, p.head_dim,
                                                           p.capacity, p.num_splits);
  if (p.workspace_bytes < needed) {
    return InvalidArgumentError("index-gather attention: workspace of " +
                                std::to_string(p.workspace_bytes) + " bytes, " +
                                std::to_string(needed) + " needed");
  }
  const int group = p.num_heads / p.num_kv_heads;
  RUBATO_DISPATCH_HEAD_DIM(p.head_dim, kHeadDim, {
    RUBATO_DISPATCH_GQA_GROUP(group, kGroup, { return Launch<kHeadDim, kGroup>(p, stream); });
  });
}

}  // namespace rubato::cuda
