// How one step's rows split over several GPU cache ranks of the device data plane: each cache
// rank receives its own requests' rows in one contiguous block (its decode rows first, as the
// plane's descriptor wants) and sends back its decode rows' attention in one block. The model's
// rows interleave the ranks, so the step is staged: gather indices pick each staging row's
// model row, scatter indices each model decode row's staging row (both go to GatherRows on the
// device). A pure function, so the split is tested on the CPU (cache_step_split_test.cc).
// docs/disaggregated.md "Several GPU cache ranks".
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "transport/device_step.h"

namespace rubato {

// One request of the step, in the model's row order (decode entries first, one row each).
struct CacheStepEntry {
  int cache = 0;  // which cache rank holds its session
  DeviceStepRun run;
};

struct CacheStepPart {
  std::vector<DeviceStepRun> runs;  // its entries, in model order
  int first_row = 0;                // its block of the staging rows
  int rows = 0;
  int first_decode_row = 0;  // its block of the staging attention rows
  int decode_rows = 0;
};

struct CacheStepSplit {
  std::vector<CacheStepPart> parts;  // [cache]
  // [rows]: the model row each staging row holds (cache 0's rows, then cache 1's, ...).
  std::vector<int32_t> gather;
  // [decode rows]: the staging attention row each model decode row reads.
  std::vector<int32_t> scatter;
  // What a captured step bakes in: every part's rows and decode rows.
  std::vector<int64_t> shape;
};

// InvalidArgument when an entry's cache is outside [0, num_caches), its run has no tokens, or a
// decode entry (one of the first `decode_rows` rows) has more than one token.
Result<CacheStepSplit> SplitStepByCache(std::span<const CacheStepEntry> entries, int decode_rows,
                                        int num_caches);

}  // namespace rubato
