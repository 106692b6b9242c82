// A request's session on a GPU cache rank, in this process (gpu_cache_residency.h) or in its own
// (device_cache_rank_residency.h): the handle its forward entries carry, the request object that
// attaches it, and the batch check both CUDA halves make (every entry holds such a session and
// no policy plan, the window is dense: attention on the cache GPU is dense attention; with
// placement, entries without a session are the inference GPU's, attended densely there).
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
  explicit GpuCacheSession(uint64_t session, int cache = 0) : session(session), cache(cache) {}
  const uint64_t session;  // the cache rank's session id
  const int cache;         // which of the residency's cache GPUs holds it (0 with one)
};

class GpuCacheRequest final : public ResidencyRequest {
 public:
  explicit GpuCacheRequest(uint64_t session, int cache = 0) : handle_(session, cache) {}
  void AttachTo(ForwardEntry& entry) const override { entry.residency = &handle_; }
  uint64_t session() const { return handle_.session; }
  int cache() const { return handle_.cache; }

 private:
  GpuCacheSession handle_;
};

// The session of an entry CheckGpuCacheBatch passed.
inline uint64_t GpuCacheSessionOf(const ForwardEntry& entry) {
  return static_cast<const GpuCacheSession&>(*entry.residency).session;
}

// `local_entries`: entries without a handle are the inference GPU's own (placement: their KV
// is wholly in its paged cache, attended there); else every entry must hold a session.
inline Status CheckGpuCacheBatch(std::span<const ForwardEntry> batch, const AttentionWindow& window,
                                 bool local_entries = false) {
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    const bool local = local_entries && entry.residency == nullptr;
    if (!local && dynamic_cast<const GpuCacheSession*>(entry.residency) == nullptr) {
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
