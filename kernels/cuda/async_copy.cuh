// Device wrappers for Hopper's asynchronous copies into shared memory: mbarriers that count
// arrivals and bytes, bulk copies of contiguous bytes, and tensor-map tile copies (the copy
// engine; docs/design.md §10 "Hopper memory access"). The kernels that stream KV tiles (decode
// attention) build their pipelines from these.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only; maps are encoded on the host, tensor_map.h)

#include <cstdint>

namespace rubato::cuda {

__device__ inline unsigned SharedAddress(const void* smem) {
  return static_cast<unsigned>(__cvta_generic_to_shared(smem));
}

// Makes `barrier` wait for `arrivals` arrivals per phase (one thread; fence before others use it).
__device__ inline void MbarrierInit(uint64_t* barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(barrier)),
               "r"(arrivals));
}

// Orders mbarrier initialisation before the copy engine or other threads use the barriers.
__device__ inline void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrives on `barrier` and adds `bytes` to the transaction count its current phase waits for.
__device__ inline void MbarrierArriveExpectTx(uint64_t* barrier, unsigned bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddress(barrier)),
      "r"(bytes)
      : "memory");
}

// Spins until the phase with parity `phase` of `barrier` has completed.
__device__ inline void MbarrierWait(uint64_t* barrier, unsigned phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(SharedAddress(barrier)),
      "r"(phase)
      : "memory");
}

// The copy engine moves `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory and signals `barrier` with them.
__device__ inline void BulkCopyToShared(void* smem_dest, const void* global_source, unsigned bytes,
                                        uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SharedAddress(smem_dest)),
      "l"(global_source), "r"(bytes), "r"(SharedAddress(barrier))
      : "memory");
}

// The copy engine moves the box of `map` at element coordinates (column, row) into shared
// memory (laid out as the map's swizzle says) and signals `barrier` with its bytes. `map` must
// live in kernel parameter space (a __grid_constant__ parameter) or global memory.
__device__ inline void TensorTileToShared(void* smem_dest, const CUtensorMap* map, int column,
                                          int row, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(SharedAddress(smem_dest)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(SharedAddress(barrier))
      : "memory");
}

// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy
// (copy engine) ones: a stage is refilled by the copy engine right after threads read it.
__device__ inline void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace rubato::cuda
