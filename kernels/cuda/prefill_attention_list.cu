// Prefill attention's PrefillMode::kList instantiations (prefill_attention_kernel.cuh).
#include "kernels/cuda/prefill_attention_kernel.cuh"

namespace rubato::cuda::prefill {

Status LaunchPrefillList(const PrefillAttentionParams& params, cudaStream_t stream) {
  return LaunchPrefillAttention<PrefillMode::kList>(params, stream);
}

}  // namespace rubato::cuda::prefill
