// Prefill attention's PrefillMode::kLse instantiations (prefill_attention_kernel.cuh).
#include "kernels/cuda/prefill_attention_kernel.cuh"

namespace rubato::cuda::prefill {

Status LaunchPrefillLse(const PrefillAttentionParams& params, cudaStream_t stream) {
  return LaunchPrefillAttention<PrefillMode::kLse>(params, stream);
}

}  // namespace rubato::cuda::prefill
