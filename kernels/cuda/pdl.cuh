// Programmatic dependent launch (Hopper): a kernel launched with LaunchPdl may be scheduled while
// the kernel before it in the stream drains, and waits for that kernel's completion and memory
// with WaitForPriorGrids, its first statement. At a decode step of few rows each small kernel
// otherwise pays its launch and ramp after the previous one's last block (docs/cuda_model.md
// "Programmatic dependent launch"). RUBATO_PDL=0 launches plainly (for comparison).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace rubato::cuda {

// Every kernel launched with LaunchPdl calls this before it touches global memory: it returns
// once the previous grid in the stream has completed and its writes are visible (at once when
// the launch was plain, or before sm_90).
__device__ __forceinline__ void WaitForPriorGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether launches carry the attribute: the device's compute capability is 9.0 or more and
// RUBATO_PDL is not "0". Read once per process (the current device's, at the first call).
bool PdlEnabled();

template <typename... KernelArgs, typename... Args>
cudaError_t LaunchPdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = PdlEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace rubato::cuda
