// A request's session on a GPU cache rank, in this process (gpu_cache_residency.h) or in its own
// (device_cache_rank_residency.h): the handle its forward entries carry, the request object that
// attaches it, and the batch check both CUDA halves make (every entry holds such a session and
// no policy plan, the window is dense: attention on the cache GPU is dense attention).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"
#include "inference_rank/model/model.h"
#include "inference_rank/residency/residency.h"
#include "kernels/cpu/attention_window.h"

namespace rubato {

class GpuCacheSession final : public ResidencyEntry {
 public:
  explicit GpuCacheSession(uint64_t session) : session(session) {}
  const uint64_t session;  // the cache rank's session id
};

class GpuCacheRequest final : public ResidencyRequest {
 public:
  explicit GpuCacheRequest(uint64_t session) : handle_(session) {}
  void AttachTo(ForwardEntry& entry) const override { entry.residency = &handle_; }
  uint64_t session() const { return handle_.session; }

 private:
  GpuCacheSession handle_;
};

// The session of an entry CheckGpuCacheBatch passed.
inline uint64_t GpuCacheSessionOf(const ForwardEntry& entry) {
  return static_cast<const GpuCacheSession&>(*entry.residency).session;
}

inline Status CheckGpuCacheBatch(std::span<const ForwardEntry> batch,
                                 const AttentionWindow& window) {
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    if (dynamic_cast<const GpuCacheSession*>(entry.residency) == nullptr) {
      return InvalidArgumentError("batch entry " + std::to_string(e) +
                                  ": every entry of a step on a GPU cache rank must hold a "
                                  "session there");
    }
    if (entry.attention != nullptr) {
      return InvalidArgumentError("batch entry " + std::to_string(e) +
                                  ": attention on the GPU cache rank is dense; the entry has a "
                                  "policy's plan");
    }
  }
  if (!window.IsDense()) {
    return InvalidArgumentError("attention on the GPU cache rank needs a dense window");
  }
  return Status::Ok();
}

}  // namespace rubato
