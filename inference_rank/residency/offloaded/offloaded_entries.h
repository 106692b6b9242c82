// The checks both model halves of the offloaded residency make of a batch (offloaded_cpu_backend,
// offloaded_cuda_backend): each entry with a residency handle carries an exchange of its own,
// no local attention plan (its cache rank's selector chooses what it attends), no slot arrays,
// and the forward's window is dense.
#pragma once

#include <span>
#include <string>

#include "common/status.h"
#include "inference_rank/model/model.h"
#include "inference_rank/residency/offloaded/kv_offload.h"
#include "kernels/cpu/attention_window.h"

namespace rubato {

// The handle the offloaded residency's engine half set (ForwardEntry::residency).
inline const OffloadForward& OffloadHandle(const ResidencyEntry* entry) {
  return static_cast<const OffloadForward&>(*entry);
}

inline Status CheckOffloadedEntries(std::span<const ForwardEntry> batch,
                                    const AttentionWindow& window) {
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    if (entry.residency == nullptr) continue;
    const std::string where = "forward: batch entry " + std::to_string(e);
    if (dynamic_cast<const OffloadForward*>(entry.residency) == nullptr) {
      return InvalidArgumentError(where + ": a residency handle not made by offloaded KV");
    }
    if (OffloadHandle(entry.residency).exchange == nullptr) {
      return InvalidArgumentError(where + ": offloaded entry without an exchange");
    }
    if (entry.attention != nullptr) {
      return InvalidArgumentError(where +
                                  " is offloaded and has a local attention plan (an "
                                  "offloaded entry attends what its cache rank returns)");
    }
    if (entry.slots != nullptr) {
      return InvalidArgumentError(where + " is both offloaded and on slot arrays");
    }
    if (!window.IsDense()) {
      return InvalidArgumentError(where + ": offloaded entries need a dense forward window");
    }
  }
  return Status::Ok();
}

}  // namespace rubato
