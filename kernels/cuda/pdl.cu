// PdlEnabled (pdl.cuh).
#include <cstdlib>
#include <string>

#include "kernels/cuda/pdl.cuh"

namespace rubato::cuda {

bool PdlEnabled() {
  static const bool enabled = [] {
    const char* flag = std::getenv("RUBATO_PDL");
    if (flag != nullptr && std::string(flag) == "0") return false;
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      return false;
    }
    return major >= 9;
  }();
  return enabled;
}

}  // namespace rubato::cuda
