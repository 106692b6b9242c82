// Tensor-core and async-copy PTX shared by the tiled attention kernels (prefill_attention):
// cp.async 16-byte copies with zero fill, ldmatrix (plain and transposed), mma.sync m16n8k16 bf16
// with fp32 accumulation, and bf16 packing. Fragment layouts are described at each wrapper.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace rubato::cuda::mma {

__device__ __forceinline__ uint32_t SharedAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16-byte asynchronous copy global -> shared; when !valid nothing is read and the 16 bytes are
// zero-filled (src-size 0), so padding rows and keys past the context are zeros, never stale
// data (0 x NaN in P V would poison the output).
__device__ __forceinline__ void CopyAsync16(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(shared)),
               "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i; register i gets
// row lane / 4, columns 2 (lane % 4) and +1 of matrix i (transposed: rows 2 (lane % 4) and +1
// of column lane / 4).
__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], const __nv_bfloat16* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(shared))
               : "memory");
}
__device__ __forceinline__ void LoadMatrixX4Transposed(uint32_t (&r)[4],
                                                       const __nv_bfloat16* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(shared))
               : "memory");
}

// d += a b for a 16x16 (row-major) bf16 A, a 16x8 (column-major) bf16 B, fp32 C/D. With
// g = lane / 4, c = 2 (lane % 4): a = {A[g][c..c+1], A[g+8][c..], A[g][c+8..], A[g+8][c+8..]},
// b = {B[c..c+1][g], B[c+8..c+9][g]}, d = {D[g][c], D[g][c+1], D[g+8][c], D[g+8][c+1]}.
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 -> one register of two bf16, `low` in the low half (the lower column of a fragment).
__device__ __forceinline__ uint32_t PackBf16x2(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

}  // namespace rubato::cuda::mma
