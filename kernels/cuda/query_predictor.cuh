// AsyncSpade's next-query predictor on the GPU (the cache rank's device selector): the assembled
// softmax-normalised ridge regression of cache_rank/query_predictor.h, for many query heads at
// once, each reading its own ring of recent queries. The CPU twin is PredictQueriesFromRings
// (cache_rank/query_predictor.h): the same rings, the same Gram and solves in double, fp32 out.
// docs/asyncspade.md "On the GPU".
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

// The largest query window W the device predictor takes (its per-window solves live in shared
// memory); AsyncSpade's default is 16.
inline constexpr int kDeviceQueryWindowMax = 16;

struct PredictQueriesParams {
  // Every head's ring of its last queries, [heads][capacity][dim] fp32, device; slot s of head h
  // at ring[(h * capacity + s) * dim].
  const float* ring = nullptr;
  // Per head, device int32: the slot the next query will be written to, and how many queries
  // the ring holds (the newest at slot next - 1, the oldest count - 1 slots before it, cyclic).
  const int32_t* next = nullptr;
  const int32_t* count = nullptr;
  float* predicted = nullptr;  // [heads][dim] fp32, device
  int heads = 0;
  int capacity = 0;    // ring slots per head, in [1, kDeviceQueryWindowMax + 1]
  int dim = 0;         // > 0
  int max_window = 0;  // W, in [0, capacity - 1]: the prediction regresses on up to W queries
  double ridge_lambda = 1e-2;  // > 0, relative to the window's mean squared norm
};

// One block per head; no allocation, no synchronisation (capturable). heads == 0 is a no-op. The
// per-head next / count live on the device, so the launcher cannot check them: a head whose count
// is outside [1, capacity] or whose next is outside [0, capacity) gets a zero prediction.
Status PredictQueries(const PredictQueriesParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
