// The split_by_head residency's half on the CPU model (cpu_residency_backend.h): per layer it
// swaps in a fetch due at this step, offloads the NR-heads' new rows, applies the policy's
// selection (split_by_head_kv.h), and writes a decode entry's attention itself: R-heads over
// every position of the paged cache, NR-heads over their front plus the recent positions, both
// through the two-segment op. Prefill chunks attend densely (the paper's prefill).
#pragma once

#include <memory>
#include <vector>

#include "common/metrics.h"
#include "inference_rank/residency/cpu_residency_backend.h"
#include "inference_rank/residency/split_by_head/split_by_head_kv.h"

namespace rubato {

// The residency's series (null until registered) and what was last published to them.
struct SplitByHeadMetrics {
  Counter* fetches = nullptr;
  Counter* rows_fetched = nullptr;
  Counter* bytes_fetched = nullptr;
  Counter* exposed_wait_seconds = nullptr;
  Gauge* local_kv_share = nullptr;
  int64_t published_fetches = 0, published_rows = 0, published_bytes = 0, published_wait_ns = 0;
  // Adds what `counters` gained since the last call.
  void Publish(const SplitByHeadCounters& counters);
};

class SplitByHeadCpuBackend final : public CpuResidencyBackend {
 public:
  SplitByHeadCpuBackend(const HeadSplit& split, SplitByHeadCounters& counters,
                        SplitByHeadMetrics& metrics)
      : split_(split), counters_(counters), metrics_(metrics) {}
  std::string_view residency_name() const override { return "split_by_head"; }

  // Refuses a windowed forward and handles that are not split_by_head's.
  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override;
  Status LayerComputed(const CpuLayerContext& layer) override;
  Result<ResidencyAttention> Attend(const CpuLayerContext& layer, int entry) override;

 private:
  const HeadSplit& split_;
  SplitByHeadCounters& counters_;
  SplitByHeadMetrics& metrics_;
  std::vector<char> decode_;                  // [entry] of the layer: a decode step
  std::vector<int> no_rows_;                  // [kv_heads] zeros: R-heads read no front
  std::vector<std::vector<float>> scratch_;   // [worker]
  int64_t local_bytes_ = 0, full_bytes_ = 0;  // this forward's decode entries
};

}  // namespace rubato
