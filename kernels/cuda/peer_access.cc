// Peer access enabled once per ordered pair of GPUs (see peer_access.h).
#include "kernels/cuda/peer_access.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_status.h"

namespace rubato::cuda {

Result<bool> EnablePeerAccessOnce(int from, int to) {
  static std::mutex mutex;
  static std::set<std::pair<int, int>> enabled;  // guarded by mutex
  const std::lock_guard<std::mutex> lock(mutex);
  if (from == to || enabled.contains({from, to})) return true;
  int can = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaDeviceCanAccessPeer(&can, from, to),
      "asking whether GPU " + std::to_string(from) + " can access GPU " + std::to_string(to));
  if (can == 0) return false;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(from), "selecting GPU " + std::to_string(from));
  const cudaError_t status = cudaDeviceEnablePeerAccess(to, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // enabled outside rubato: not an error, keep the state clean
  } else if (status != cudaSuccess) {
    return CudaStatus(status, "enabling peer access from GPU " + std::to_string(from) + " to GPU " +
                                  std::to_string(to));
  }
  enabled.insert({from, to});
  return true;
}

}  // namespace rubato::cuda
