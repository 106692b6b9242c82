// The split_by_head residency's half on the CUDA model (cuda_residency_backend.h,
// docs/synckv.md "On the GPU"): per layer it appends every token of its entries to where the
// KV lives, the R-heads' rows to their device pools and the NR-heads' rows to the store (pinned
// host memory or another GPU, written by the device directly), and after each step it adds the
// exposed fetch wait, the rows fetched and the local KV bytes to the counters. What a decode
// token attends (the R-heads' pools, the NR-heads' compact pool plus the recent positions) and
// the selections are the policy's backend half's (SyncKV). Plain decode rows (row group 0) get
// dense attention over the paged cache. Eager only: the policy's steps are not graph-replayable.
#pragma once

#include <memory>
#include <vector>

#include "inference_rank/model/cuda_pinned_buffer.h"
#include "inference_rank/residency/cuda_residency_backend.h"
#include "inference_rank/residency/split_by_head/split_by_head_cpu_backend.h"
#include "inference_rank/residency/split_by_head/split_by_head_cuda_kv.h"

namespace rubato {

class SplitByHeadCudaBackend final : public CudaResidencyBackend {
 public:
  SplitByHeadCudaBackend(std::shared_ptr<SplitByHeadDeviceKv> kv, const ModelConfig& model,
                         SplitByHeadCounters& counters, SplitByHeadMetrics& metrics)
      : kv_(std::move(kv)), model_(model), counters_(counters), metrics_(metrics) {}
  std::string_view residency_name() const override { return "split_by_head"; }
  bool graph_replayable() const override { return false; }

  // Refuses a windowed forward, another residency's handles and positions past the capacity.
  Status CheckBatch(std::span<const ForwardEntry> batch,
                    const AttentionWindow& window) const override;
  Status PlanStep(std::span<const ForwardEntry> batch, const ForwardPlan& plan) override;
  Status BeginStep(cudaStream_t main) override;
  Status LayerComputed(const CudaLayerContext& layer) override;
  Status AttendDecodeRows(const CudaLayerContext& layer, int first_row, int rows,
                          const AttentionWindow& window) override;
  Status FinishStep() override;
  void AbortStep() override;

 private:
  std::shared_ptr<SplitByHeadDeviceKv> kv_;
  ModelConfig model_;
  SplitByHeadCounters& counters_;
  SplitByHeadMetrics& metrics_;
  int tokens_ = 0;
  cudaStream_t main_ = nullptr;
  PinnedBuffer staging_;                    // [tokens] int32: each row's store row, or -1
  cuda::DeviceBuffer<int32_t> store_rows_;  // the same, on the device
  // This step's decode entries (their host schedule, read after the step) and positions.
  std::vector<std::pair<const SplitByHeadCudaRequest*, int>> decode_;
};

}  // namespace rubato
