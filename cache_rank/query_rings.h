// AsyncSpade's query rings on a GPU cache rank, the CPU twins of kernels/cuda/query_rings.cuh:
// pushing each step entry's last query (bf16, from the step's q|k|v rows) into its session's
// ring of recent queries (fp32), and packing each entry's predicted query (fp32, what the
// predictor wrote) into the bf16 query rows the device selection reads. The rings are the
// layout PredictQueries / PredictQueriesFromRings read (query_predictor.h), one layer of every
// session slot: [slots][heads][capacity][dim], next / count [slots][heads]. docs/asyncspade.md
// "On a GPU cache rank".
#pragma once

#include <cstdint>
#include <span>

namespace rubato {

// One step's entries as the ring ops read them (each [entries]): the session slot of entry e,
// the row of its last query in the step's rows, and whether it restarts the window (a prompt
// chunk of more than one token: its queries are not consecutive steps, so the window starts
// again from its last, as the CPU selector's).
struct QueryRingEntries {
  std::span<const int32_t> slot;
  std::span<const int32_t> row;
  std::span<const int32_t> restart;
};

// For every entry e and head h: when restart[e], the ring of (slot[e], h) is emptied (next 0,
// count 0); then the query of head h at rows[row[e] * row_stride + h * dim ..] (bf16 bits) is
// widened to fp32 into slot next of that ring, next advances cyclically and count grows up to
// capacity. An entry whose slot is outside [0, slots) is skipped (the device op does the same).
void PushQueryRowsCpu(std::span<float> ring, std::span<int32_t> next, std::span<int32_t> count,
                      std::span<const uint16_t> rows, int64_t row_stride,
                      const QueryRingEntries& entries, int slots, int heads, int capacity, int dim);

// out[e * out_stride + h * dim + d] = bf16(predicted[(slot[e] * heads + h) * dim + d]) (round to
// nearest even) for every entry e; an entry whose slot is outside [0, slots) gets zeros.
void PackPredictedQueriesCpu(std::span<const float> predicted, std::span<const int32_t> slot,
                             int slots, int heads, int dim, int64_t out_stride,
                             std::span<uint16_t> out);

}  // namespace rubato
