// AsyncSpade's query rings on the cache GPU (query_rings.cuh).
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/query_rings.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) PushQueryRowsKernel(PushQueryRowsParams p) {
  const int e = static_cast<int>(blockIdx.x);
  const int h = static_cast<int>(blockIdx.y);
  const int slot = p.entry_slot[e];
  if (slot < 0 || slot >= p.slots) return;
  const size_t ring_index = static_cast<size_t>(slot) * p.heads + h;
  int at = p.next[ring_index];
  int held = p.count[ring_index];
  if (p.entry_restart[e] != 0 || at < 0 || at >= p.capacity) {
    at = 0;
    held = 0;
  }
  const __nv_bfloat16* q = p.rows + p.entry_row[e] * p.row_stride + static_cast<int64_t>(h) * p.dim;
  float* to = p.ring + (ring_index * p.capacity + static_cast<size_t>(at)) * p.dim;
  for (int d = static_cast<int>(threadIdx.x); d < p.dim; d += kThreads) {
    to[d] = __bfloat162float(q[d]);
  }
  // Every thread has read next / count above; the write waits for them all.
  __syncthreads();
  if (threadIdx.x == 0) {
    p.next[ring_index] = (at + 1) % p.capacity;
    p.count[ring_index] = min(max(held, 0) + 1, p.capacity);
  }
}

__global__ void __launch_bounds__(kThreads)
    PackPredictedQueriesKernel(PackPredictedQueriesParams p) {
  const int e = static_cast<int>(blockIdx.x);
  const int slot = p.entry_slot[e];
  const int row = p.heads * p.dim;
  __nv_bfloat16* to = p.out + static_cast<int64_t>(e) * p.out_stride;
  const bool valid = slot >= 0 && slot < p.slots;
  const float* from = p.predicted + static_cast<size_t>(valid ? slot : 0) * row;
  for (int i = static_cast<int>(threadIdx.x); i < row; i += kThreads) {
    to[i] = __float2bfloat16_rn(valid ? from[i] : 0.0f);
  }
}

}  // namespace

Status PushQueryRows(const PushQueryRowsParams& p, cudaStream_t stream) {
  if (p.entries < 0 || p.slots < 0 || p.heads < 0 || p.capacity < 1 || p.dim <= 0 ||
      p.row_stride < static_cast<int64_t>(p.heads) * p.dim) {
    return InvalidArgumentError(
        "push query rows: entries " + std::to_string(p.entries) + ", slots " +
        std::to_string(p.slots) + ", heads " + std::to_string(p.heads) + ", capacity " +
        std::to_string(p.capacity) + " (>= 1), dim " + std::to_string(p.dim) + ", row_stride " +
        std::to_string(p.row_stride) + " (>= heads x dim)");
  }
  if (p.entries == 0 || p.heads == 0) return Status::Ok();
  if (p.ring == nullptr || p.next == nullptr || p.count == nullptr || p.rows == nullptr ||
      p.entry_slot == nullptr || p.entry_row == nullptr || p.entry_restart == nullptr) {
    return InvalidArgumentError(
        "push query rows: ring, next, count, rows and the entry tables must be set");
  }
  PushQueryRowsKernel<<<dim3(p.entries, p.heads), kThreads, 0, stream>>>(p);
  return CudaStatus(cudaGetLastError(), "push query rows launch");
}

Status PackPredictedQueries(const PackPredictedQueriesParams& p, cudaStream_t stream) {
  if (p.entries < 0 || p.slots < 0 || p.heads < 0 || p.dim <= 0 ||
      p.out_stride < static_cast<int64_t>(p.heads) * p.dim) {
    return InvalidArgumentError("pack predicted queries: entries " + std::to_string(p.entries) +
                                ", slots " + std::to_string(p.slots) + ", heads " +
                                std::to_string(p.heads) + ", dim " + std::to_string(p.dim) +
                                ", out_stride " + std::to_string(p.out_stride) +
                                " (>= heads x dim)");
  }
  if (p.entries == 0 || p.heads == 0) return Status::Ok();
  if (p.predicted == nullptr || p.entry_slot == nullptr || p.out == nullptr) {
    return InvalidArgumentError(
        "pack predicted queries: predicted, entry_slot and out must be set");
  }
  PackPredictedQueriesKernel<<<p.entries, kThreads, 0, stream>>>(p);
  return CudaStatus(cudaGetLastError(), "pack predicted queries launch");
}

}  // namespace rubato::cuda
