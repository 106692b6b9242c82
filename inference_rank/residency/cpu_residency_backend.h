// The model half of a residency on the CPU model (cpu_model.h): per layer, after the local KV
// append, the new K/V and last query of the entries it holds (ForwardEntry::residency) go to
// it, and for each of them it says what the entry's attention reads: the local paged cache, a
// compact segment (rows that arrived from elsewhere) plus the local recent segment through the
// two-segment op, or nothing because it wrote the entry's attention output rows itself (e.g. a
// partial result computed elsewhere, merged with a local segment). docs/residency.md.
#pragma once

#include <span>

#include "common/status.h"
#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/residency/residency_backend.h"
#include "kernels/cpu/attention_window.h"

namespace rubato {

// What one entry of a residency attends in one layer.
struct ResidencyAttention {
  enum class Kind {
    kLocal,       // the paged cache, as an entry without a residency
    kTwoSegment,  // `compact`, then positions [recent_begin, position + 1) of the paged cache
    kWritten,     // the residency wrote the entry's rows of CpuLayerContext::output
  };
  Kind kind = Kind::kLocal;
  CompactSegment compact;  // kTwoSegment: valid until the layer ends
  int recent_begin = 0;    // kTwoSegment
};

class CpuResidencyBackend : public ResidencyBackend {
 public:
  std::string_view backend_name() const final { return "cpu"; }

  // The residency's checks of a batch Model::Forward validated (its entries' handles, the
  // window), before anything is reserved or written.
  virtual Status CheckBatch(std::span<const ForwardEntry> /*batch*/,
                            const AttentionWindow& /*window*/) const {
    return Status::Ok();
  }
  // After the layer's local KV append, before its attention: the new K/V (layer.k, layer.v) and
  // queries (layer.q) of the entries with a handle (CpuEntryRows::residency), in batch order.
  virtual Status LayerComputed(const CpuLayerContext& layer) = 0;
  // What entry `entry` (an index into layer.entries; it has a handle) attends in the layer.
  virtual Result<ResidencyAttention> Attend(const CpuLayerContext& layer, int entry) = 0;
};

}  // namespace rubato
