// Row gather (gather_rows.cuh): kernel, launcher, validation.
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gather_rows.cuh"

namespace rubato::cuda {
namespace {

constexpr int kMaxThreads = 256;

// One block per output row; its threads copy the row in 16-byte vectors (8 bf16).
__global__ void GatherRowsKernel(const uint4* __restrict__ in, int in_rows,
                                 const int32_t* __restrict__ row_indices, int vectors_per_row,
                                 uint4* __restrict__ out) {
  const int row = blockIdx.x;
  const int source = row_indices[row];
  uint4* dest = out + static_cast<int64_t>(row) * vectors_per_row;
  if (source < 0 || source >= in_rows) {
    // 0x7fff7fff... is a quiet bf16 NaN in every lane.
    const uint4 nan = make_uint4(0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu);
    for (int v = threadIdx.x; v < vectors_per_row; v += blockDim.x) dest[v] = nan;
    return;
  }
  const uint4* src = in + static_cast<int64_t>(source) * vectors_per_row;
  for (int v = threadIdx.x; v < vectors_per_row; v += blockDim.x) dest[v] = src[v];
}

Status Validate(const GatherRowsParams& p);

}  // namespace

Status GatherRows(const GatherRowsParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.rows == 0) return Status::Ok();
  const int vectors_per_row = params.dim / 8;
  // A warp multiple, no more threads than vectors (decode rows of a 4096-wide model: 512).
  int threads = (vectors_per_row + 31) / 32 * 32;
  if (threads > kMaxThreads) threads = kMaxThreads;
  GatherRowsKernel<<<params.rows, threads, 0, stream>>>(
      reinterpret_cast<const uint4*>(params.in), params.in_rows, params.row_indices,
      vectors_per_row, reinterpret_cast<uint4*>(params.out));
  return LaunchStatus("gather_rows");
}

namespace {

Status Validate(const GatherRowsParams& p) {
  const std::string op = "GatherRows: ";
  if (p.rows < 0) return InvalidArgumentError(op + "rows " + std::to_string(p.rows) + " < 0");
  if (p.rows == 0) return Status::Ok();
  if (p.dim <= 0 || p.dim % 8 != 0) {
    return InvalidArgumentError(op + "dim " + std::to_string(p.dim) +
                                " must be a positive multiple of 8");
  }
  if (p.in_rows <= 0) {
    return InvalidArgumentError(op + "in_rows " + std::to_string(p.in_rows) + " must be > 0");
  }
  if (p.in == nullptr) return InvalidArgumentError(op + "in is null");
  if (p.row_indices == nullptr) return InvalidArgumentError(op + "row_indices is null");
  if (p.out == nullptr) return InvalidArgumentError(op + "out is null");
  if (reinterpret_cast<uintptr_t>(p.in) % 16 != 0 || reinterpret_cast<uintptr_t>(p.out) % 16 != 0) {
    return InvalidArgumentError(op + "in and out must be 16-byte aligned");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
