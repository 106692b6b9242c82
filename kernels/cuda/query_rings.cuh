// AsyncSpade's query rings on a GPU cache rank: pushing each step entry's last query (bf16, from
// the step's q|k|v rows on the cache GPU) into its session's ring of recent queries (fp32, the
// layout PredictQueries reads, query_predictor.cuh), and packing each entry's predicted query
// (fp32) into bf16 query rows for the device selection (DeviceQueries). The CPU twins are
// PushQueryRowsCpu and PackPredictedQueriesCpu (cache_rank/query_rings.h, the same contract).
// docs/asyncspade.md "On a GPU cache rank".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace rubato::cuda {

struct PushQueryRowsParams {
  float* ring = nullptr;                // [slots][heads][capacity][dim] fp32, device (one layer)
  int32_t* next = nullptr;              // [slots][heads], device: the slot the next query goes to
  int32_t* count = nullptr;             // [slots][heads], device: queries held
  const __nv_bfloat16* rows = nullptr;  // the step's rows; head h of row r at r * stride + h * dim
  int64_t row_stride = 0;               // elements, >= heads * dim
  // [entries] each, device: the entry's session slot (skipped outside [0, slots)), the row of
  // its last query, and 1 when it restarts the window (a prompt chunk).
  const int32_t* entry_slot = nullptr;
  const int32_t* entry_row = nullptr;
  const int32_t* entry_restart = nullptr;
  int entries = 0;
  int slots = 0;
  int heads = 0;
  int capacity = 0;  // W + 1, >= 1
  int dim = 0;
};

// One block per (entry, head); no allocation, no synchronisation (capturable). Two entries of one
// launch must name different slots. A ring whose next is outside [0, capacity) restarts.
Status PushQueryRows(const PushQueryRowsParams& params, cudaStream_t stream);

struct PackPredictedQueriesParams {
  const float* predicted = nullptr;     // [slots][heads][dim] fp32, device
  const int32_t* entry_slot = nullptr;  // [entries], device; outside [0, slots): zeros
  __nv_bfloat16* out = nullptr;         // entry e's row at out + e * out_stride
  int64_t out_stride = 0;               // elements, >= heads * dim
  int entries = 0;
  int slots = 0;
  int heads = 0;
  int dim = 0;
};

// out = bf16(predicted of each entry's slot), round to nearest even; capturable.
Status PackPredictedQueries(const PackPredictedQueriesParams& params, cudaStream_t stream);

}  // namespace rubato::cuda
