// SwiGLU (see swiglu.h). torch's silu is x / (1 + exp(-x)) in fp32; so is this.
#include "kernels/cpu/swiglu.h"

#include <cmath>

namespace rubato {

void SwiGlu(const float* gate, const float* up, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    const float silu = g / (1.0f + std::exp(-g));
    out[i] = silu * up[i];
  }
}

}  // namespace rubato
