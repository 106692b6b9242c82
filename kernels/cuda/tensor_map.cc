// Tensor map encoding (tensor_map.h) through the runtime's driver entry point: rubato links the
// CUDA runtime only, not libcuda, so cuTensorMapEncodeTiled is looked up once at first use.
#include "kernels/cuda/tensor_map.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <string>

namespace rubato::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      function = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

}  // namespace

Status EncodeBf16RowsMap(const __nv_bfloat16* base, const Bf16RowsMapShape& shape,
                         CUtensorMap& map) {
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || shape.rows < 1 ||
      shape.rows >= (int64_t{1} << 31) || shape.row_elements < 1 || shape.row_elements % 8 != 0 ||
      shape.box_columns < 1 || shape.box_columns * 2 > 128 || shape.box_rows < 1 ||
      shape.box_rows > 256) {
    return InvalidArgumentError("tensor map: base must be 16-byte aligned, 1 <= rows < 2^31, "
                                "row_elements a multiple of 8, box <= 64 columns x 256 rows");
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return UnavailableError("CUDA: cuTensorMapEncodeTiled is not available");
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(shape.row_elements),
                              static_cast<cuuint64_t>(shape.rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(shape.row_elements) * 2};  // bytes
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(shape.box_columns),
                             static_cast<cuuint32_t>(shape.box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(base), dims,
             strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    return InternalError("CUDA: cuTensorMapEncodeTiled failed (CUresult " +
                         std::to_string(static_cast<int>(result)) + ")");
  }
  return Status::Ok();
}

}  // namespace rubato::cuda
