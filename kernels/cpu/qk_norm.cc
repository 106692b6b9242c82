// Qwen3 q/k-norm (see qk_norm.h): the RMSNorm op applied to rows of head_dim.
#include "kernels/cpu/qk_norm.h"

#include "kernels/cpu/rmsnorm.h"

namespace rubato {

void HeadRmsNormInPlace(float* x, const float* weight, int tokens, int heads, int head_dim,
                        float eps) {
  RmsNorm(x, weight, tokens * heads, head_dim, eps, x);
}

}  // namespace rubato
