// The CUDA half of the offloaded residency over several GPU cache ranks of the device data plane
// (device_cache_rank_residency.h): each step's rows split by the rank holding their session
// (cache_step_split.h), staged per layer by a row gather into one block per rank, sent to every
// rank, then every rank's decode attention received and scattered back into the model's rows,
// all on the model's stream. A rank that is lost, or whose transfers fail, is left out of the
// step; its requests end (RequestBroken) and the others go on. docs/disaggregated.md "Several
// GPU cache ranks".
#pragma once

#include <memory>
#include <span>

#include "common/status.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/cuda_residency_backend.h"
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"

namespace rubato {

// The batch check of both CUDA halves over the device data plane (one rank or several):
// CheckGpuCacheBatch, and the step within the plane's limits.
Status CheckDevicePlaneBatch(std::span<const ForwardEntry> batch, const AttentionWindow& window,
                             const DevicePlaneLimits& limits);
// Both halves' AttendDecodeRows: LayerComputed wrote every decode row, so it is called once,
// from row 0.
Status CheckDecodeRowsFromZero(int first_row, int rows);

// Buffers on the model's GPU sized by the ranks' limits (max_rows, max_runs; Attach checked
// they agree).
Result<std::unique_ptr<CudaResidencyBackend>> MakeDeviceCacheRanksBackend(
    DeviceCacheRankResidency& residency, CudaModel& model);

}  // namespace rubato
