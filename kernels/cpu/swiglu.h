// SwiGLU activation of the Llama / Qwen MLP: out = silu(gate) * up, silu(x) = x / (1 + e^-x).
#pragma once

#include <cstdint>

namespace rubato {

//   gate, up, out: [count], f32 (typically [tokens][intermediate]); out may alias gate or up.
void SwiGlu(const float* gate, const float* up, int64_t count, float* out);

}  // namespace rubato
