// Prefill attention's PrefillMode::kPool instantiations (prefill_attention_kernel.cuh).
#include "kernels/cuda/prefill_attention_kernel.cuh"

namespace rubato::cuda::prefill {

Status LaunchPrefillPool(const PrefillAttentionParams& params, cudaStream_t stream) {
  return LaunchPrefillAttention<PrefillMode::kPool>(params, stream);
}

}  // namespace rubato::cuda::prefill
