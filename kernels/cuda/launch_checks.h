// Host-side checks shared by the CUDA op launchers' input validation.
#pragma once

#include <cstdint>

namespace rubato::cuda {

// 16-byte aligned: what the ops' vector loads and stores need.
inline bool Aligned16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

}  // namespace rubato::cuda
